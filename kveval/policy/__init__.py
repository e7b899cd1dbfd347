"""The policy feature: which QuantSpec each layer's keys and values get, and when a cached token is read quantized.

- ``policy``: ``KVPolicy`` and ``LayerOverride``, the data (validated, frozen) and its queries;
- ``parse``: the config form of a policy -> fields, one-line errors with their path;
- ``checks``: the checks of a policy's fields (transforms, modes, specs against their schedule, widths against a
  model), one-line errors;
- ``selectors``: the layer selector grammar (``"0-3"``, ``"last 2"``, ...);
- ``masks``: the quantization schedule (which token is read in full precision by which query);
- ``presets``: the one table of named policies (name -> config + description);
- ``plan_file``: the ``kveval plan`` file's one schema (``PlanFile``), written by ``kveval plan`` and read back
  (a config's ``plan:``, the predictions its run reports, ``kveval deploy``).

Pure data and maths: nothing here imports transformers.
"""

from kveval.policy.policy import AUTO_SCALES, PREFILL_MODES, RESIDUAL_MODES, KVPolicy, LayerOverride
from kveval.policy.presets import POLICY_PRESETS, policy_descriptions, policy_names

__all__ = ["AUTO_SCALES", "POLICY_PRESETS", "PREFILL_MODES", "RESIDUAL_MODES", "KVPolicy", "LayerOverride",
           "policy_descriptions", "policy_names"]
