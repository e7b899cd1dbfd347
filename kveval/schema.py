"""Pure data: the base of every config model (closed, strict types), the one YAML reader, the one text reader.

``load_yaml(text, source)`` is ``yaml.safe_load`` made strict for input that a user wrote by hand: a duplicate
key (``{mine: int2_g32, mine: int8}``, which safe_load resolves by silently keeping the last), a tag (``!!binary``,
``!!set``, ``!!python/...``, ``!function``), nesting deeper than ``MAX_YAML_DEPTH`` (which would overflow the
stack) and aliases that expand to more than ``MAX_YAML_NODES`` nodes (a "billion laughs") are each one
:class:`KvevalError` line. ``read_text_file(path, what)`` reads UTF-8 text (a UTF-8 byte order mark is dropped)
and names UTF-16, other encodings and binary files in one line instead of a ``UnicodeDecodeError``.
``is_finite_number(value)`` is what a number read from a JSON file must be.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, TypeGuard

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict

from kveval.errors import KvevalError

MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 200_000
#: the lowest sampling temperature a config may give (generation's ``temperature``, lm-eval's ``gen_kwargs``):
#: samplers divide the logits by it, and logits that are finite in the model's dtype (at most float32's, and
#: bfloat16's, 3.4e38) divided by 1e-6 stay finite even in float64 (3.4e44; the difference softmax takes from the
#: largest logit, twice that); 5e-324, which passes ``> 0``, makes every scaled logit infinite and the
#: probabilities NaN. Below it, sampling is greedy decoding in effect (a logit gap of 1e-4 weighs e^100).
MIN_TEMPERATURE = 1e-6


class Strict(BaseModel):
    """The base of every config section: unknown keys are errors, types are strict."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)

    def check_unique(self, *fields: str) -> None:
        """ValueError (``"depths has duplicates"``) when a list field holds a value twice (None counts as empty)."""
        for name in fields:
            values = getattr(self, name) or []
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has duplicates")


def is_finite_number(value: Any) -> TypeGuard[float]:
    """An int or float (not a bool) that is finite: what a number read from a JSON file must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_count(value: Any) -> Any:
    """A count written with a unit (``"32k"``, ``"128Ki"``, ``"1M"``) as its whole number; anything else unchanged,
    for the field's own checks (a plain string stays a string and is refused as one)."""
    if isinstance(value, str) and value.strip()[-1:].lower() in ("k", "i", "m"):
        from kveval.units import parse_count

        try:
            return parse_count(value.strip(), "count")
        except KvevalError as exc:
            raise ValueError(str(exc)) from None
    return value


#: a count of tokens in a config: a whole number, or one with a unit (``32k`` = ``32Ki`` = 32,768; ``1M``)
Tokens = Annotated[int, BeforeValidator(_token_count)]


# --------------------------------------------------------------------------------------------- YAML


def _refuse_tag(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    raise KvevalError(f"not valid YAML at line {node.start_mark.line + 1}: the tag "
                      f"{node.tag.replace('tag:yaml.org,2002:', '!!')} is not allowed; configs are plain data (no tags)")


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate keys, data tags (binary, set, omap, pairs) and deep nesting."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        """PyYAML composes recursively: refuse deep nesting before Python's stack runs out."""
        if self._depth >= MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise KvevalError(f"nesting deeper than {MAX_YAML_DEPTH} levels at line {mark.line + 1}; a config is "
                              "a few levels deep")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        """A key written twice in one mapping is an error (merge keys ``<<`` may still be overridden)."""
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    continue
                if duplicate:
                    raise KvevalError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}: each key may "
                                      "appear once in a mapping")
        return super().construct_mapping(node, deep=deep)


for _tag in ("binary", "set", "omap", "pairs"):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)
_StrictLoader.add_constructor(None, _refuse_tag)  # any other tag (!!python/..., !function, !foo)


def _expanded_size(node: yaml.Node) -> int:
    """Nodes of the document with every alias expanded (capped a little above MAX_YAML_NODES); a recursive alias
    is an error. Memoised per node, so a billion laughs costs its size in YAML, not in nodes."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise KvevalError(f"recursive alias at line {n.start_mark.line + 1}: configs are plain trees")
        active.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            for child in n.value:
                total = min(total + size(child), MAX_YAML_NODES + 1)
        elif isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                total = min(total + size(k) + size(v), MAX_YAML_NODES + 1)
        active.discard(key)
        sizes[key] = total
        return total

    return size(node)


def load_yaml(text: str, source: str = "config") -> Any:
    """Parse YAML ``text`` into plain data (dicts, lists, strings, numbers, booleans, None, dates).

    Errors are one :class:`KvevalError` line that starts with ``source``: a syntax error with its line, a
    duplicate key, a tag, nesting deeper than ``MAX_YAML_DEPTH``, more than ``MAX_YAML_NODES`` nodes once the
    aliases are expanded, a recursive alias.
    """
    loader = _StrictLoader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if _expanded_size(node) > MAX_YAML_NODES:
                raise KvevalError(f"more than {MAX_YAML_NODES} values once its aliases are expanded; a config is "
                                  "small (no alias bombs)")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:  # a tag of an unknown kind
        raise KvevalError(f"{source}: not valid YAML: {_yaml_problem(exc)}; configs are plain data (no tags)") from None
    except yaml.YAMLError as exc:
        raise KvevalError(f"{source}: not valid YAML{_yaml_where(exc)}; check the indentation and quoting") from None
    except RecursionError:  # pragma: no cover - compose_node stops nesting first
        raise KvevalError(f"{source}: nested too deeply") from None


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = (getattr(exc, "problem", None) or str(exc).splitlines()[0]).strip()
    return f"{problem}{_yaml_where(exc)}"


# --------------------------------------------------------------------------------------------- text


def decode_text(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text (a leading byte order mark dropped); a one-line KvevalError naming what it looks
    like instead (UTF-16/32, binary, another 8-bit encoding) and where the first bad byte is."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise KvevalError(f"{source}: the file is UTF-16 (or UTF-32), not UTF-8; save it as UTF-8")
    if b"\x00" in data[:65536]:
        raise KvevalError(f"{source}: the file is binary (it holds NUL bytes), not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise KvevalError(f"{source}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); save it as "
                          "UTF-8 (Latin-1 and other encodings are not read)") from None


def read_text_file(path: str | Path, what: str = "file", max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``path``; one-line KvevalErrors for a missing, unreadable, too large or non-UTF-8 file.

    ``what`` names the file in the messages ("config file", "corpus file"); ``max_bytes`` refuses larger files
    before reading them.
    """
    from kveval.fileio import NOT_REGULAR, open_regular

    try:
        with open_regular(path) as fh:  # a FIFO, socket or device is refused before it is opened
            size = os.fstat(fh.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise KvevalError(f"{what} '{path}' is {size} bytes, more than the {max_bytes} a {what} may have")
            data = fh.read()
    except FileNotFoundError:
        raise KvevalError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise KvevalError(f"{what} '{path}' is a folder, not a file") from None
    except OSError as exc:
        if exc.strerror == NOT_REGULAR:
            raise KvevalError(f"{what} '{path}' is {NOT_REGULAR}; give the path of a file") from None
        raise KvevalError(f"{what} '{path}' cannot be read ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:  # a path holding a NUL byte
        raise KvevalError(f"{what} '{path}' cannot be read ({exc})") from None
    return decode_text(data, f"{what} '{path}'")
