"""The parts a ``PersonalizedStrategy`` is composed of, one concern per module.

``nodes`` (which node is which client, and what it holds), ``sampling`` (who is sent a message),
``messages`` (one message per node), ``replies`` (a reply's parts and their validation),
``fused`` (round t's evaluation riding on round t + 1's training messages), ``outcome`` (what a
round returns) and ``context`` (the run's facts a strategy is built with). The privacy parts are
chosen at build from the run config: ``exchange`` (how a round's replies travel: plain, or
SecAgg+), ``accounting`` (the count of DP releases: none, local or central) and ``averaging``
(FedAvg's update of its global tensors: weighted average, DP-FedAvg or the SecAgg+ mean). The
method hooks stay on the strategy (``strategies.base``).
"""
