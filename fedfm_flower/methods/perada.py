"""PerAda (Xie, Huang, Chu, Xu, Xiao, Li, Anandkumar, "PerAda: Parameter-Efficient Federated
Learning Personalization with Generalization Guarantees", CVPR 2024): a personalized adapter v_i
per client pulled towards a global adapter w, and a global adapter that the server improves by
knowledge distillation from the ensemble of the clients' adapters on unlabelled auxiliary data.

Round t, clients S^t (the authors' code: github.com/NVlabs/PerAda, ``optim/our.py``,
``aggregation/distillation.py``; read, not copied):

1. The server sends w^t. Each client i (a) updates its personal adapter on its loss plus the
   proximal term towards the RECEIVED w^t,
   ``v_i <- v_i - eta (grad f_i(v_i) + lambda (v_i - w^t))``, and (b) updates w^t with FedAvg's
   local solver into w_i^t, which it sends back (``client_apps.perada``: Ditto's client with
   PerAda's lambda). v_i never leaves the client; evaluation uses v_i.
2. The server averages: w_bar = FedAvg(w_i^t) (``FedAvgStrategy``'s average).
3. Server distillation (``fedfm_flower.learners.perada``): starting from w_bar, ``perada-kd-steps``
   steps on batches of the auxiliary set x of
   ``KL(softmax(mean_i f(x; w_i^t) / T) || softmax(f(x; w) / T))`` over w (the student), the
   teacher being the mean LOGITS of the reporting clients' returned models w_i^t
   (``fedfm_flower.tasks.distillation.softened_kl``, no T^2 factor). The result is w^{t+1}.

Hyper-parameters: ``perada-lambda`` 0.1 (pFedSeq's Appendix B, tuned over {0.01, 0.1, 1, 10});
``perada-kd-steps`` 100 and ``perada-kd-lr`` 0.005 (pFedSeq, the latter tuned over {0.001,
0.005, 0.01, 0.05}); ``perada-kd-batch-size`` 128 and ``perada-kd-temperature`` 1 (the authors'
argparse defaults ``kd_batch_size``, ``kd_KL_temperature``); ``perada-kd-rounds`` 0 (distil every
round; the authors' scripts stop after round 30, ``kd_max_round``).

Choices, and why:

* **What the adapters hold.** w and v_i are every trainable tensor of the run: the LoRA adapter
  AND the head (``Split(shared=None)``, as Ditto). The authors' "adapter" model updates, averages,
  personalizes and distils the adapters, the batch-norm layers and the classifier ``fc`` alike
  (``update_layer_name`` in ``optim/our.py``; the personal model is a full copy of the global
  one), and pFedSeq runs every baseline on LoRA + head. So the personalized model is v_i's
  adapter + v_i's head, and distillation trains the global adapter and the global head (the
  student must own the logits it is distilled on).
* **The proximal term** is lambda/2 ||v_i - w^t||^2 (the paper's objective, as Ditto's here:
  ``fedfm_flower.tasks.training.proximal_term``). The authors' code adds ``lmbda * ||v - w||^2``
  (twice the gradient), so their ``lmbda`` is our lambda / 2. v's schedule, optimizer and step size
  are the run's (``local-epochs``/``local-steps``, ``lr``), on w's batches in w's order: the authors
  train both with the same SGD, epochs and lr. The order (v, then w in the authors' code; w,
  then v here, as Ditto) does not matter: v's anchor is the received w^t.
* **The teacher** is the plain mean of the logits of the clients that replied this round (the
  authors' ``out_t += logits / len(models)``), in eval mode (no dropout: a fixed target; the
  authors' teachers are left in train mode after local training, an accident of the loop). The
  average of step 2 is FedAvg's, by training examples, as every FedAvg-family method here (the
  authors average uniformly); the student starts from it.
* **The student's optimizer** is the authors': Adam at ``perada-kd-lr`` with a cosine annealing
  of the step size to 0 over the round's KD steps, fresh each round, student in train mode.
* **A fixed number of KD steps.** The authors also evaluate the student every
  ``kd_eval_batches_freq`` steps on a LABELLED server validation split, keep the best step, and
  fall back to w_bar when distillation does not beat it. That needs labels on the server, which
  the paper's unlabelled auxiliary data (and pFedSeq's "100 KD steps") does not have: here the
  student after ``perada-kd-steps`` steps is w^{t+1}, always.
* **KD batches.** Seeded per round (``round_seed`` of the run's seed, the server and the round):
  passes over the auxiliary set in fresh random orders, the last batch of a pass possibly
  smaller (the authors' ``DataLoader`` with a random sampler, restarted when exhausted). The
  teacher's logits are computed once per round for the rows those batches use.
* **The auxiliary set** (``perada-aux-data``), unlabelled, never a client's training or test
  data:

  - ``public`` (default): the run dataset's public split, held out before partitioning
    (``public-fraction``; glyph-domains' fixed print/photo/painting split), pretraining and
    test parts together, labels dropped. No client holds any of it. It is the authors' own
    choice when the KD data is the run's dataset (``read_data.py``: a server split held out
    from the training set). On digits-domains it is clean, untransformed digits while each
    client sees its domain.
  - ``glyphs``: glyph-domains' public split (4,800 printed, photographed and painted digits,
    rendered from fonts and photos in installed packages): another source of images of the
    same kind, as the paper's CIFAR-10 for CIFAR-100 (pFedSeq) or CIFAR-100 for CIFAR-10 (the
    authors' scripts). It contains none of scikit-learn's scans, so no digits client holds any
    of it. (scikit-learn's digits are NOT offered as auxiliary data for glyph-domains: its
    handwriting clients are drawn from those scans.)

  - ``cifar10``: all of CIFAR-10 (training and test images, 60,000), pFedSeq's auxiliary data
    (its Appendix B distils on CIFAR-10 on every dataset of its Table 1), from
    ``perada-aux-dir`` (a local copy, as ``data-dir`` reads one) or the Hub's
    ``uoft-cs/cifar10``; resized as the run's images. Refused for a CIFAR-10 run, whose
    clients hold those images.
* **Privacy.** The teacher reads each client's returned adapter, not only their average:
  SecAgg+ (the sum only) and central DP (noise on the average only) cannot serve it. Local DP
  can: the distillation reads the clients' noised replies and public data only
  (post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import ConfigError, MethodSettings, setting

# Where the server's unlabelled auxiliary images come from (module docstring).
AUX_DATA: tuple[str, ...] = ("public", "cifar10", "glyphs")


@dataclass(frozen=True)
class PerAdaSettings(MethodSettings):
    """PerAda's keys: field ``lambda_`` is run-config key ``perada-lambda``, ``kd_steps`` is
    ``perada-kd-steps``, ..."""

    prefix: ClassVar[str] = "perada"

    lambda_: float = setting(
        0.1,
        non_negative=True,
        doc=(
            "proximal weight lambda pulling each personal adapter towards the received global "
            "one, lambda/2 times their squared L2 distance (>= 0; pFedSeq sets 0.1 of "
            "{0.01, 0.1, 1, 10})"
        ),
    )
    kd_steps: int = setting(
        100,
        non_negative=True,
        doc=(
            "server distillation steps per round on the auxiliary data (pFedSeq: 100); `0` "
            "turns distillation off (FedAvg's global adapter, the authors' PerAda w/o KD)"
        ),
    )
    kd_lr: float = setting(
        0.005,
        positive=True,
        doc=(
            "Adam step size of the server distillation, cosine-annealed to 0 over the round's "
            "steps (> 0; pFedSeq sets 0.005 of {0.001, 0.005, 0.01, 0.05})"
        ),
    )
    kd_batch_size: int = setting(
        128,
        positive=True,
        doc="auxiliary images per distillation step (the authors' default: 128)",
    )
    kd_temperature: float = setting(
        1.0,
        positive=True,
        doc="softmax temperature T of the distillation's KL, no T^2 factor (the authors: 1)",
    )
    kd_rounds: int = setting(
        0,
        non_negative=True,
        doc=(
            "> 0: distil in the first that many rounds only, FedAvg's average after; `0`: "
            "every round (the authors' scripts: 30)"
        ),
    )
    aux_data: str = setting(
        "public",
        choices=AUX_DATA,
        doc=(
            "unlabelled auxiliary images of the distillation: `public` (the run dataset's "
            "public split, which no client holds), `glyphs` (glyph-domains' public split: "
            "another source of digit images) or `cifar10` (all of CIFAR-10, the paper's for "
            "CIFAR-100; from `perada-aux-dir` or the Hub)"
        ),
    )
    aux_dir: str = setting(
        "",
        doc=(
            "with `perada-aux-data = cifar10`: a local copy of CIFAR-10 (a `save_to_disk` "
            "directory with the Hub copy's `img` and `label` columns); empty loads "
            "`uoft-cs/cifar10` from the Hub (needs internet)"
        ),
        example="data/cifar10",
    )

    def check(self) -> None:
        """``perada-aux-dir`` is read only for CIFAR-10 (the server checks that it exists)."""
        if self.aux_dir and self.aux_data != "cifar10":
            raise ConfigError(
                self.key_of("aux_dir"),
                self.aux_dir,
                f"is read only with {self.key_of('aux_data')} = 'cifar10' (it is "
                f"'{self.aux_data}')",
            )

    def distils(self, server_round: int) -> bool:
        """Whether the server distils in ``server_round``."""
        return self.kd_steps > 0 and (self.kd_rounds == 0 or server_round <= self.kd_rounds)


# Tuned besides the common training keys (fedfm_flower.study.search): the ends of pFedSeq's grids
# (its Appendix B, the table this row belongs to): lambda over {0.01, 0.1, 1, 10}, the KD step
# size over {0.001, 0.005, 0.01, 0.05}.
SEARCH = {
    "perada-lambda": LogUniform(0.01, 10.0),
    "perada-kd-lr": LogUniform(0.001, 0.05),
}

CAPABILITIES = Capabilities(
    central_dp="its server distils from each client's returned adapter (an ensemble teacher), "
    "not only from their noised average",
    local_dp=None,  # the distillation reads the noised replies and public data only
    secagg="its server distils from each client's returned adapter, which needs more than "
    "their sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "perada",
        strategy="strategies.perada:PerAdaStrategy",
        client="client_apps.perada:PerAdaClient",
        summary="personal adapters with a proximal pull to the global one; the server distils "
        "the clients' ensemble into the averaged global adapter on auxiliary data "
        "(Xie et al. 2024)",
        settings=PerAdaSettings,
        modalities=("image",),  # the distillation's auxiliary set is images
        split=Split(shared=None, local=()),
        # w travels; v (a second copy of every trainable tensor) stays on the client, and each
        # round passes the data twice (w's schedule, then v's).
        profile=ResourceProfile(copies=2, passes=2),
        search=SEARCH,
        capabilities=CAPABILITIES,
        no_batchnorm=(
            "its server distils the adapters on auxiliary data and expects parameters only; "
            "BatchNorm statistics are not carried through its distillation yet"
        ),
    ),
)
