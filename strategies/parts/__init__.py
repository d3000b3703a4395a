"""The parts a ``PersonalizedStrategy`` is composed of, one concern per module.

``nodes`` (which node is which client, and what it holds), ``sampling`` (who is sent a message),
``messages`` (one message per node), ``replies`` (a reply's parts and their validation),
``fused`` (round t's evaluation riding on round t + 1's training messages), ``outcome`` (what a
round returns) and ``context`` (the run's facts a strategy is built with). The method hooks stay
on the strategy (``strategies.base``).
"""
