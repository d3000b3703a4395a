"""Differential privacy of what travels: central and local DP, and secure aggregation.

The mechanism is DP-FedAvg's (McMahan et al. 2018, "Learning differentially private recurrent
language models"), as Flower's ``DifferentialPrivacyClientSideFixedClipping`` and
``fixedclipping_mod`` build it:

* each client clips its update of the shared tensors, Delta_i = (sent) - (received), to an L2
  norm of at most C over all its shared tensors together (``mechanism.clip_update``), and sends
  received + clipped Delta_i;
* the server averages the clipped updates with equal weights over the m clients it sampled
  (a fixed denominator: a client that does not reply adds a zero update) and adds Gaussian
  noise of standard deviation sigma * C / m to every coordinate of the average
  (``mechanism.noise_std``, ``mechanism.add_gaussian_noise``), drawn fresh from OS entropy so
  no party can regenerate it (``noise``);
* the privacy spent is client-level (epsilon, delta) after T releases, sensitivity C, from
  Opacus' RDP accountant (``accountant``), the releases counted by the run's ledger, once
  each, across resumes too (``ledger``).

Local DP (``dp = "local"``, Flower's ``LocalDpMod`` in spirit) moves the noise to the client:
each client clips its update to C and adds N(0, (sigma C)^2) per coordinate before sending
(``mechanism.privatize_locally``), so the server sees only privatized updates and aggregates
them as without DP. Each round is one Gaussian release per participating client at
sensitivity 2C (any two datasets of one client); the epsilon reported after t releases is a
bound for every client.

Secure aggregation (``secagg = true``, ``secagg``): Flower's SecAgg+ client mod behind
``client_apps.secagg`` and our driver of its four stages on the server; the server learns only
the weighted mean of the clients' updates.

Modules: ``support`` (which methods can take which mode, and why not; light, read by the config),
``mechanism`` (clipping and noising), ``noise`` (draws no one can regenerate), ``accountant``
(epsilon per neighbouring relation), ``ledger`` (the releases, written ahead of each),
``secagg`` (SecAgg+'s server side). Flower's DP strategy wrapper and client mod are not used
as they are (our strategies aggregate per tensor over owners and keep their state keyed by
client id), but the composition is Flower's: the strategy is built of parts chosen from the run
config (``strategies.parts``: the exchange, plain or SecAgg+; FedAvg's update, the weighted
average, DP-FedAvg or the SecAgg+ mean; the release accounting, none, local or central), and
the client clips (and, under local DP, noises) in ``client_apps.app`` before the reply is built.
"""
