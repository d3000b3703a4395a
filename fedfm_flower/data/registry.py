"""The dataset registry: dataset name -> where it comes from and how its columns are named.

The config's ``dataset`` key allows exactly these names (``fedfm_flower.config.keys``). Two entries
are embedded and offline (scikit-learn's digits, as label-skew ``digits`` and feature-skew
``digits-domains``); the others are the papers' benchmarks, loaded from a local copy
(``data-dir``) or, where a public copy is known, from the Hugging Face Hub by name.

Hub copies: ``uoft-cs/cifar10``, ``uoft-cs/cifar100`` and ``zh-plus/tiny-imagenet`` are the
common ones.
``wltjr1007/DomainNet`` is a public copy whose card lists ``image``/``label``; if a copy lacks
the ``domain`` column, name the right one with ``natural-id-column``. We know of no Hub copy of
Office-Caltech10, Dermoscopic-FL, Office-Home or of Omniglot with drawer ids, so those need
``data-dir`` (layouts in ``fedfm_flower.data.loaders``); OrganAMNIST is read from MedMNIST's own
``organamnist.npz`` under ``data-dir`` (``fedfm_flower.data.medmnist``). Following the papers,
DomainNet keeps only its ten most frequent classes (pFedPG and pFedSeq follow FedBN's
sub-dataset), and Omniglot predicts the alphabet (50 classes) with one client per drawer
(pFedSeq's real-world setting). ``flan`` is FedDPA's federated Flan data, read from the
authors' per-client JSON files under ``data-dir`` or from a Hub id (``fedfm_flower.data.flan``).
``multitask`` is TAP's multi-modal multi-task setting, built offline from glyph-domains and the
instruction corpus (``fedfm_flower.data.multitask``; task ``multimodal-multitask``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset comes from, its column names and its number of classes."""

    hub_name: str  # "" when offline-embedded or when no Hub copy is known
    image_column: str
    label_column: str
    natural_id_column: str  # "" when the dataset has no natural client ids
    num_classes: int  # after ``top_classes`` is applied
    top_classes: int = 0  # keep only the most frequent classes (0: keep all)
    embedded: bool = False  # prepared in-process, never downloaded
    summary: str = ""
    task: str = "image-classification"  # fedfm_flower.tasks
    medmnist_flag: str = ""  # a MedMNIST subset, read from <flag>.npz (fedfm_flower.data.medmnist)


DATASETS: dict[str, DatasetSpec] = {
    "digits": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="",
        num_classes=10,
        embedded=True,
        summary="scikit-learn digits (1,797 8x8 images); label skew via the partitioner",
    ),
    "digits-domains": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=10,
        embedded=True,
        summary="digits with one synthetic visual domain per client (feature skew)",
    ),
    "glyph-domains": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=10,
        embedded=True,
        summary="digits in six DomainNet-like styles (print, handwriting, photo, sketch, "
        "painting, noisy-blur), generated from installed packages; fixed public split",
    ),
    "cifar10": DatasetSpec(
        hub_name="uoft-cs/cifar10",
        image_column="img",
        label_column="label",
        natural_id_column="",
        num_classes=10,
        summary="CIFAR-10, 60,000 32x32 images; label skew (pFedPG)",
    ),
    "cifar100": DatasetSpec(
        hub_name="uoft-cs/cifar100",
        image_column="img",
        label_column="fine_label",
        natural_id_column="",
        num_classes=100,
        summary="CIFAR-100, 60,000 32x32 images; label skew (pFedSeq, pFedPG)",
    ),
    "tiny-imagenet": DatasetSpec(
        hub_name="zh-plus/tiny-imagenet",
        image_column="image",
        label_column="label",
        natural_id_column="",
        num_classes=200,
        summary="Tiny-ImageNet, 110,000 64x64 images; label skew (pFedSeq)",
    ),
    "domainnet": DatasetSpec(
        hub_name="wltjr1007/DomainNet",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=10,
        top_classes=10,
        summary="DomainNet top-10 classes, six domains, one client per domain (pFedSeq, pFedPG)",
    ),
    "office-caltech10": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=10,
        summary="Office-Caltech10, four domains, one client per domain (pFedPG); needs data-dir",
    ),
    "dermoscopic-fl": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=3,
        summary="Dermoscopic-FL, 10,490 dermoscopic images of 3 skin-lesion classes from four "
        "hospital sites (HAM10K, MSK), one client per site (pFedPG); needs data-dir "
        "<site>/<class>/<image>",
    ),
    "omniglot": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="alphabet",
        natural_id_column="drawer",
        num_classes=50,
        summary="Omniglot, predict the alphabet, one client per drawer (pFedSeq); needs data-dir",
    ),
    "office-home": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="domain",
        num_classes=65,
        summary="Office-Home, 15,500 images of 65 classes in four domains (Art, Clipart, "
        "Product, Real World); FedPerfix's setting is partitioner domain-dirichlet with "
        "num-clients 16 and dirichlet-alpha 1.0 (client p gets domain p mod 4, each domain "
        "split over its 4 clients by Dirichlet over labels); needs data-dir",
    ),
    "organamnist": DatasetSpec(
        hub_name="",
        image_column="image",
        label_column="label",
        natural_id_column="",
        num_classes=11,
        medmnist_flag="organamnist",
        summary="MedMNIST OrganAMNIST, 58,850 gray 28x28 (or 224x224) abdominal CT slices, 11 "
        "organs, all splits pooled; label skew (FedPerfix: Dirichlet 0.5, 64 clients); needs "
        "data-dir holding organamnist.npz",
    ),
    "instructions": DatasetSpec(
        hub_name="",
        image_column="",
        label_column="",
        natural_id_column="",
        num_classes=0,
        embedded=True,
        summary="offline instruction-following tasks, one task per client "
        "(fedfm_flower.data.instructions); generation and classification in generative form",
        task="instruction-following",
    ),
    "flan": DatasetSpec(
        hub_name="",
        image_column="",
        label_column="",
        natural_id_column="",
        num_classes=0,
        summary="FedDPA's federated Flan datasets (8 Flan tasks, one per client): data-dir is "
        "the directory of the authors' local_training_{i}.json / local_test_{i}.json files, or "
        "a Hub dataset id with a task or category column (fedfm_flower.data.flan)",
        task="instruction-following",
    ),
    "multitask": DatasetSpec(
        hub_name="",
        image_column="",
        label_column="",
        natural_id_column="",
        num_classes=0,
        embedded=True,
        summary="TAP's multi-modal multi-task federation (fedfm_flower.data.multitask): image "
        "classification and reconstruction and VQA on glyph-domains images, text classification "
        "and generation from the instruction corpus; 3 client groups with different pairs",
        task="multimodal-multitask",
    ),
}


def dataset_spec(name: str) -> DatasetSpec:
    """The registry entry of ``name``, or a ValueError naming the known datasets."""
    if name not in DATASETS:
        raise ValueError(f"dataset '{name}' unknown; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def looks_like_hub_name(data_dir: str) -> bool:
    """Whether ``data_dir`` reads as a Hub dataset id (``owner/name``) rather than a path."""
    owner, slash, name = data_dir.partition("/")
    return bool(slash and owner and name) and "/" not in name and owner[0] not in ".~"
