"""``kveval ls``: what kveval knows by name, one list per kind (the command line prints them)."""

from __future__ import annotations

#: what ``kveval ls`` lists, in order: the word to name it, and its title
LISTS = {
    "presets": "KV policy presets (kv: NAME); checked: how a preset named after a system was checked (system: a test runs "
                "the system here; reference: a test runs a reference written from its source; documented: no test)",
    "formats": "Quantizer presets (key:/value:/spec: NAME, also usable as a policy)",
    "tasks": "Tasks",
    "models": "Builtin models (model: NAME)",
    "corpora": "Corpora (data: NAME or a .txt/.jsonl/.parquet path)",
    "shapes": "Named shapes (kveval memory --shape NAME)",
}


def list_rows(what: str) -> list[tuple[str, ...]]:
    """The rows of one list of ``kveval ls`` (imports only what that list needs)."""
    if what == "presets":
        from kveval.policy.presets import policy_descriptions
        from kveval.policy.provenance import check_of

        def checked(name: str) -> str:
            check = check_of(name)
            return "" if check is None else f"checked: {check.kind} ({check.test or 'no test'})"

        # one text column: a third one was cut at 80 columns
        return [(n, f"{d}; {checked(n)}" if checked(n) else d) for n, d in policy_descriptions().items()]
    if what == "formats":
        from kveval.quant import preset, preset_names

        return [(n, preset(n).describe()) for n in preset_names()]
    if what == "tasks":
        from kveval.config import TASK_TYPES
        from kveval.tasks import task_presets

        rows = [(k, (v.__doc__ or "").strip().splitlines()[0]) for k, v in TASK_TYPES.items()]
        return rows + [(name, f"preset: {path.name}") for name, path in task_presets().items()]
    if what == "models":
        from kveval.models import builtin_models

        return list(builtin_models().items())
    if what == "corpora":
        from kveval.data import builtin_corpora

        return list(builtin_corpora().items())
    from kveval.memory.shapes import NAMED_SHAPES

    return [(n, str(s.get("source", ""))) for n, s in NAMED_SHAPES.items()]


__all__ = ["LISTS", "list_rows"]
