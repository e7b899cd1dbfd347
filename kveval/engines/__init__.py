"""The serving engines kveval writes commands for, as data and as the rules that turn a policy into their syntax.

- ``names``: the engines' names and the check of a user's ``--engine`` (light: no torch, so that the CLI refuses
  a typo before it imports anything heavy);
- ``tables``: what each engine can run as a KV cache (``ENGINES``: its cache types, the kveval spec that computes
  each and the preset that reproduces it, how a policy may vary across layers and between K and V, the transforms
  its own cache applies, how its types are written);
- ``express``: a policy in an engine's own syntax (``express``), or why it cannot be (``NotExpressible``), and
  ``deploy``: every (engine, policy), with the nearest runnable policies where one is not expressible;
- ``costs``: the cost of an engine's uniform policies, measured in a run or predicted from a scan (``Costs``,
  ``nearest_options``).

``kveval plan --engine`` (the sensitivity planner) plans within ``tables``; ``kveval deploy`` prints ``express``.
Pure: no transformers import. This face imports nothing, so that ``kveval.engines.names`` stays light.
"""
