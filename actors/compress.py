"""Tool result compression: what the model reads of a result too large for its context.

Pure functions over decoded JSON values (no I/O, no clock), so what they return can be
stored in an event and replayed byte for byte:

- `preview` describes a result in at most `budget` characters, in seed 003's shape
  (`[STORED: key | tool]`, `Type: Array(30)`, `Schema: ...`, the first items, and how to
  reach the rest), degrading (fewer items, shorter clips, a shorter schema) to fit;
- `recall` returns the result, or the part a path selects, one page within the budget;
- `transform` applies a JMESPath expression (never `eval`) to the result.

A result that is a string holding a JSON array or object (MCP text content often is) is
read as that JSON by all three; `result_text` is what the model would see uncompressed.
Lengths are Python characters, not bytes.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

import jmespath
import jmespath.exceptions
import jmespath.functions
import jmespath.visitor
import msgspec

from schemas.errors import ToolbusError

DEFAULT_BUDGET: Final = 800
DEFAULT_ITEMS: Final = 3
MIN_BUDGET: Final = 200
# The key is shown twice and never clipped (a clipped key could not be recalled), so
# it is bounded: a header, a type line and the shortest hint then fit MIN_BUDGET.
MAX_KEY_CHARS: Final = 64
_TOOL_CHARS = 48
_SAMPLE = 5  # items (and elements of nested arrays) whose paths make a schema
_MAX_DEPTH = 6
_MAX_PATHS = 200
_MAX_KEYS = 100  # keys of one object looked at for a schema or an item's fields
_MAX_NODES = 25
_ITEM_DEPTH = 4
_MIN_ITEM = 24  # narrower item lines are not worth showing
_TOKEN_CHARS = 16  # ids, dates and other unquoted tokens are clipped shorter than prose
_EXPRESSION_CHARS = 80

_encode = msgspec.json.Encoder().encode  # keys stay in the order given
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIMPLE_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[-?\d+\])*", re.ASCII)
_TOKEN = re.compile(r"[A-Za-z0-9_.:@/+#-]+")
_JSON_LITERAL = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_JSON_START = re.compile(r"\s*[\[{]")


class TransformError(ToolbusError, ValueError):
    """A `_transform` or `recall` path expression could not be compiled or evaluated."""

    def __init__(self, expression: str, reason: str) -> None:
        self.expression = expression
        self.reason = reason
        shown = _clip(expression, _EXPRESSION_CHARS)
        super().__init__(f"JMESPath expression {_json(shown)} {reason}; fix the "
                         "expression, or leave it out")


def result_text(result: Any) -> str:
    """The text the model reads uncompressed: a string as is, anything else as compact
    JSON with its keys in their given order."""
    return result if isinstance(result, str) else _json(result)


def needs_compression(result: Any, budget: int = DEFAULT_BUDGET) -> bool:
    """Whether `result_text(result)` is longer than `budget` characters."""
    return len(result_text(result)) > budget


def preview(result: Any, *, key: str, tool: str, budget: int = DEFAULT_BUDGET,
            items: int = DEFAULT_ITEMS) -> str:
    """A structured description of `result` in at most `budget` characters, one part a
    line: `[STORED: key | tool]`, the type, the schema (dotted JMESPath field paths), the
    first `items` items as `path=value`, and how to reach the rest. Built whatever the
    result's size: call it when `needs_compression` says so."""
    if budget < MIN_BUDGET:
        raise ValueError(f"budget {budget} is too small for a preview: use at least "
                         f"{MIN_BUDGET} characters")
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise ValueError(f"key {_clip(key, MAX_KEY_CHARS)!r} must be 1 to {MAX_KEY_CHARS} "
                         "characters: it is shown whole so that it can be recalled")
    if items < 0:
        raise ValueError(f"items must be 0 or more, not {items}")
    header = f"[STORED: {key} | {_clip(tool, _TOOL_CHARS)}]"
    room = budget - len(header)
    value = _parsed(result)
    body: list[str]
    if isinstance(value, list):
        body = _array_preview(value, key, room, items)
    elif isinstance(value, dict):
        blocks = _content_blocks(value)
        body = (_object_preview(value, key, room, items) if blocks is None
                else _content_preview(value, blocks, key, room))
    elif isinstance(value, str):
        body = _text_preview(value, key, room)
    else:
        body = _scalar_preview(value, room)
    return "\n".join([header, *body])


def recall(result: Any, *, path: str | None = None, offset: int = 0,
           limit: int | None = None, budget: int = DEFAULT_BUDGET) -> dict[str, Any]:
    """One page of `result`, or of the part the JMESPath `path` selects.

    An array pages by items, an object by keys, text by characters: `offset` is the
    first one, `limit` the most to return (otherwise as many as fit `budget` characters
    of compact JSON, or of text; the budget caps `limit` too). At least one item comes
    back: one over the budget is shortened, and the page says so in `note`. Following
    `next_offset` until it is None returns the whole, unless a page had a `note`.

    The page: `path`, `type` ("array", "object", "text" or "value"), then `offset`,
    `count`, `total`, `next_offset` and `items` (a list), `fields` (an object) or `text`;
    or, for a number, boolean or null, just `value`."""
    if offset < 0:
        raise ValueError(f"offset must be 0 or more, not {offset}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be 1 or more, not {limit}")
    if budget < MIN_BUDGET:
        raise ValueError(f"budget {budget} is too small: use at least {MIN_BUDGET}")
    value = _parsed(result) if path is None else transform(result, path)
    page: dict[str, Any] = {"path": path}
    if isinstance(value, list):
        page.update(_page(value, enumerate(value), offset, limit, budget, path))
    elif isinstance(value, dict):
        page.update(_page(value, value.items(), offset, limit, budget, path))
    elif isinstance(value, str):
        start = min(offset, len(value))
        count = min(limit or budget, budget, len(value) - start)
        end = start + count
        page.update(type="text", offset=start, count=count, total=len(value),
                    text=value[start:end], next_offset=end if end < len(value) else None)
    else:
        page.update(type="value", value=value)
    return page


MAX_TRANSFORM_NODES: Final = 200_000  # values one transform may visit, build and return
MAX_TRANSFORM_CHARS: Final = 4_000_000  # characters of the strings in its value


def transform(result: Any, expression: str) -> Any:
    """`expression` (JMESPath) applied to `result`; a string is first read as JSON when
    it is JSON. Raises `TransformError` if the expression is invalid or fails.

    Bounded: an expression can build a value exponentially larger than its input
    (`@|[@,@]|[@,@]|...` shares references, `[]` flattens them), so evaluation counts the
    nodes it visits and the lists it flattens; each function call, the elements of the
    arrays and objects it is given and the characters of the text it scans; `to_string`
    and `join` measure their whole input first. All of it from one budget for the whole
    evaluation (a function called once per element of a large projection spends it
    each time), and the value is measured as the tree it would encode to."""
    try:
        compiled = _compiled(expression)
    except (jmespath.exceptions.JMESPathError, RecursionError) as exc:
        reason = _parse_reason(exc) if isinstance(exc, jmespath.exceptions.JMESPathError) \
            else "it nests too deeply"
        raise TransformError(expression, f"is not valid: {reason}") from exc
    data = result
    if isinstance(result, str):
        try:
            data = msgspec.json.decode(result)
        except (msgspec.DecodeError, RecursionError):
            pass
    try:
        value = _Bounded().visit(compiled.parsed, data)
        _measure(value)
        return value
    except _TooLarge as exc:
        raise TransformError(expression, f"failed: {exc}; select less") from exc
    except jmespath.exceptions.JMESPathTypeError as exc:
        # Its own message prints the whole value, which may be shared references to a
        # large text nested many times over (gigabytes once written out).
        raise TransformError(expression, _clip(
            f"failed: in function {exc.function_name}(), a value of type "
            f"{exc.actual_type} where it takes {' or '.join(map(str, exc.expected_types))}",
            200)) from exc
    except (jmespath.exceptions.JMESPathError, TypeError, ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TransformError(expression, f"failed: {_clip(reason, 160)}") from exc


class _TooLarge(Exception):
    pass


class _Budget:
    """What one evaluation may still spend: steps (nodes visited, elements flattened,
    values measured), characters (of what it encodes: `to_string`, `join`), and scan
    (what the C code under a function or a comparison goes through: an element handed
    to a function counts `_SCAN_PER_ELEMENT`, a character of text one)."""

    __slots__ = ("chars", "scan", "steps")

    def __init__(self) -> None:
        self.steps = MAX_TRANSFORM_NODES
        self.chars = MAX_TRANSFORM_CHARS
        self.scan = MAX_TRANSFORM_SCAN

    def spend(self, steps: int, chars: int = 0) -> None:
        self.steps -= steps
        self.chars -= chars
        if self.steps < 0:
            raise _TooLarge(f"it takes over {MAX_TRANSFORM_NODES:,} steps")
        if self.chars < 0:
            raise _TooLarge(f"it builds over {MAX_TRANSFORM_CHARS:,} characters")

    def scanned(self, units: int) -> None:
        self.scan -= units
        if self.scan < 0:
            raise _TooLarge("its functions and comparisons read over "
                            f"{MAX_TRANSFORM_SCAN:,} characters (an element counts "
                            f"{_SCAN_PER_ELEMENT})")


# A function handed a large array or text, or a comparison of large values, runs in C
# (or in jmespath's type check, a short Python loop per element): cheap each time, but
# once per element of a projection over shared references it adds up. About a third of a
# second of the event loop at most, on a slow machine.
MAX_TRANSFORM_SCAN: Final = 64_000_000
_SCAN_PER_ELEMENT: Final = 16


def _measure(value: Any, budget: _Budget | None = None) -> int:
    """Raise `_TooLarge` if `value`, encoded as a tree (shared references counted each
    time), would hold more values or characters of strings than `budget` has left (a
    fresh one: `MAX_TRANSFORM_NODES` and `MAX_TRANSFORM_CHARS`); spends them, and
    returns how many values it holds."""
    budget = budget or _Budget()
    stack = [value]
    count = 0
    while stack:
        item = stack.pop()
        count += 1
        budget.spend(1)
        if isinstance(item, str):
            budget.spend(0, len(item))
        elif isinstance(item, dict):
            for k, v in item.items():
                budget.spend(0, len(k))
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _scan_cost(value: Any) -> int:
    """What reading `value` once costs, shallowly (see `_Budget.scanned`)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | dict):
        return len(value) * _SCAN_PER_ELEMENT
    return 0


# Functions whose cost does not grow with their arguments' size.
_FLAT_COST = frozenset({"length", "type", "not_null", "abs", "ceil", "floor", "to_array"})
# Functions whose cost grows with the whole of their arguments: measured first.
_DEEP_COST = frozenset({"to_string", "join"})


class _Functions(jmespath.functions.Functions):  # type: ignore[misc]
    """JMESPath's functions, each call charged to its evaluation's budget: the whole
    argument for the two that encode one (`to_string`, `join`), else a scan of the
    elements of each array or object and the characters of each text (`contains` and
    `starts_with` compare them; `sort`, `max`, `merge` and the rest go through every
    element); `contains` of a large value in an array, that value once per element."""

    def __init__(self, budget: _Budget) -> None:
        super().__init__()
        self._budget = budget

    def call_function(self, function_name: str, resolved_args: list[Any]) -> Any:
        budget = self._budget
        budget.spend(1)
        if function_name in _DEEP_COST:
            for arg in resolved_args:
                _measure(arg, budget)
        elif function_name not in _FLAT_COST:
            budget.scanned(sum(_scan_cost(arg) for arg in resolved_args))
            if function_name == "contains" and len(resolved_args) == 2 and \
                    isinstance(resolved_args[0], list) and \
                    isinstance(resolved_args[1], list | dict):
                budget.scanned(len(resolved_args[0]) *
                               _measure(resolved_args[1], budget) * _SCAN_PER_ELEMENT)
        return super().call_function(function_name, resolved_args)

    @jmespath.functions.signature(  # type: ignore[untyped-decorator]
        {"types": ["string"]}, {"types": ["array-string"]})
    def _func_join(self, separator: str, array: list[str]) -> Any:
        self._budget.spend(0, len(separator) * max(len(array) - 1, 0))
        return super()._func_join(separator, array)


class _Bounded(jmespath.visitor.TreeInterpreter):  # type: ignore[misc]
    """The interpreter, counting the nodes it visits and the elements it flattens
    (before it builds the flat list), and what its comparisons read; its functions
    charge the same budget."""

    def __init__(self) -> None:
        self._budget = _Budget()
        super().__init__(jmespath.Options(custom_functions=_Functions(self._budget)))

    def visit(self, node: Any, *args: Any, **kwargs: Any) -> Any:
        self._budget.spend(1)
        return super().visit(node, *args, **kwargs)

    def visit_flatten(self, node: Any, value: Any) -> Any:
        base = self.visit(node["children"][0], value)
        if not isinstance(base, list):
            return None  # as jmespath: only a list flattens
        self._budget.spend(sum(len(e) if isinstance(e, list) else 1 for e in base))
        merged: list[Any] = []
        for element in base:
            if isinstance(element, list):
                merged.extend(element)
            else:
                merged.append(element)
        return merged

    def visit_comparator(self, node: Any, value: Any) -> Any:
        left = self.visit(node["children"][0], value)
        right = self.visit(node["children"][1], value)
        # Two texts are compared up to the shorter; two arrays or objects, value by value.
        if isinstance(left, str) and isinstance(right, str):
            self._budget.scanned(min(len(left), len(right)))
        elif isinstance(left, list | dict) and isinstance(right, type(left)):
            smaller = left if len(left) <= len(right) else right
            self._budget.scanned(_measure(smaller, self._budget) * _SCAN_PER_ELEMENT)
        return _compare(self, node["value"], left, right)


def _compare(interpreter: Any, op: str, left: Any, right: Any) -> Any:
    """jmespath's `visit_comparator` on values already evaluated."""
    compare = interpreter.COMPARATOR_FUNC[op]
    if op in interpreter._EQUALITY_OPS:
        return compare(left, right)
    if not (jmespath.visitor._is_comparable(left) and
            jmespath.visitor._is_comparable(right)):
        return None  # ordering is for numbers (and texts) only
    return compare(left, right)


# -- helpers

@functools.lru_cache(maxsize=128)
def _compiled(expression: str) -> Any:
    return jmespath.compile(expression)


def _parse_reason(exc: jmespath.exceptions.JMESPathError) -> str:
    if isinstance(exc, jmespath.exceptions.EmptyExpressionError):
        return "the expression is empty"
    if isinstance(exc, jmespath.exceptions.IncompleteExpressionError):
        return "the expression ends too early (an unclosed bracket or brace?)"
    if isinstance(exc, jmespath.exceptions.LexerError):
        return f"{exc.message} at column {exc.lexer_position}"
    if isinstance(exc, jmespath.exceptions.ParseError):
        token = _clip(str(exc.token_value), 40)
        return f"unexpected {_json(token)} at column {exc.lex_position}"
    return _clip(str(exc).splitlines()[0], 160)


def _json(value: Any) -> str:
    return _encode(value).decode()


def _clip(text: str, width: int) -> str:
    """`text` in at most `width` characters, ending in "…" when cut."""
    if len(text) <= width:
        return text
    return text[:width - 1] + "…" if width > 0 else ""


def _parsed(result: Any) -> Any:
    if isinstance(result, str) and _JSON_START.match(result):
        try:
            return msgspec.json.decode(result)
        except (msgspec.DecodeError, RecursionError):
            pass
    return result


def _segment(key: Any) -> str:
    """A key as a JMESPath identifier, quoted when it is not a bare one."""
    key = str(key)
    return key if _IDENT.fullmatch(key) else _json(key)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return f"Object({_plural(len(value), 'key')})" if value else "{}"
    if isinstance(value, list):
        return f"Array({len(value)})" if value else "[]"
    return ""


def _value(value: Any, cap: int) -> str:
    """One value, compact: prose quoted and clipped to about `cap` characters, tokens
    (ids, dates, names) unquoted and clipped shorter, containers by kind and size."""
    if isinstance(value, str):
        text, cut = value, False
        newline = value.find("\n")
        if newline >= 0:
            text, cut = value[:newline], True
        token = _TOKEN.fullmatch(value) is not None and not _JSON_LITERAL.fullmatch(value)
        width = min(cap, _TOKEN_CHARS) if token else cap
        if len(text) > width:
            text, cut = text[:max(width - 1, 1)], True
        text += "…" if cut else ""
        return text if token else _json(text)
    if isinstance(value, dict | list):
        small = _cut(value, cap, 8, 2)  # bounded: never encodes a large value whole
        text = _json(small) if small == value else ""
        return text if text and len(text) <= cap else _kind(value)
    return _clip(_json(value), max(cap, 8))


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def _fields(item: dict[Any, Any]) -> list[tuple[str, Any]]:
    """An object's leaves as (dotted path, value), shallow ones first; arrays and
    nested objects (shown by size) after scalars, URLs last: they say little in a
    preview."""
    found: list[tuple[str, Any]] = []
    queue: deque[tuple[str, dict[Any, Any], int]] = deque([("", item, 1)])
    while queue and len(found) < _MAX_PATHS:
        prefix, node, depth = queue.popleft()
        for k, v in itertools.islice(node.items(), _MAX_KEYS):
            path = prefix + _segment(k)
            if isinstance(v, dict) and v and depth < _ITEM_DEPTH:
                queue.append((path + ".", v, depth + 1))
            else:
                found.append((path, v))
    return sorted(found, key=lambda f: 2 if _is_url(f[1]) else int(isinstance(f[1], dict | list)))


def _schema(values: list[Any]) -> tuple[list[str], bool]:
    """The union of the field paths of the first objects of an array, shallow ones
    first (`a`, `b[]`, `c.d`, `b[].e`) and those holding only URLs last; other items by
    JSON type. The flag says whether the list is complete."""
    found: dict[str, None] = {}
    urls: dict[str, None] = {}
    for v in values[:_SAMPLE]:
        if not isinstance(v, dict):
            found.setdefault(_type_name(v))
    queue: deque[tuple[str, list[dict[Any, Any]], int]] = deque(
        [("", [v for v in values[:_SAMPLE] if isinstance(v, dict) and v], 1)])
    complete = True
    while queue:
        prefix, nodes, depth = queue.popleft()
        children: dict[str, list[Any]] = {}
        for node in nodes:
            for k, v in itertools.islice(node.items(), _MAX_KEYS):
                children.setdefault(_segment(k), []).append(v)
            complete = complete and len(node) <= _MAX_KEYS
        for name, vs in children.items():
            path = prefix + name
            objects: list[dict[Any, Any]] = []
            elements: list[dict[Any, Any]] = []
            for v in vs:
                if isinstance(v, dict) and v and depth < _MAX_DEPTH:
                    objects.append(v)
                elif isinstance(v, list):
                    sample = v[:_SAMPLE]
                    dicts = [e for e in sample if isinstance(e, dict) and e]
                    if dicts and depth < _MAX_DEPTH:
                        elements += dicts
                    if len(dicts) < len(sample) or not v or depth >= _MAX_DEPTH:
                        found.setdefault(path + "[]")
                elif _is_url(v) and path not in found:
                    urls.setdefault(path)
                else:
                    urls.pop(path, None)
                    found.setdefault(path)
            if objects:
                queue.append((path + ".", objects[:_MAX_NODES], depth + 1))
            if elements:
                queue.append((path + "[].", elements[:_MAX_NODES], depth + 1))
            if len(found) + len(urls) >= _MAX_PATHS:
                return [*found, *urls], False
    return [*found, *urls], complete


def _type_name(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _list_line(label: str, entries: list[str], width: int, complete: bool = True
               ) -> str | None:
    """`label` and as many `entries` as fit in `width`, then "… +N" for the rest."""
    def rest(n: int) -> str:
        return (f"… +{n}" if complete else f"… +{n} or more") if n else ""

    line, shown = label, 0
    for i, entry in enumerate(entries):
        entry = _clip(entry, 60)
        sep = ", " if shown else ""
        tail = rest(len(entries) - i - 1)
        if len(line) + len(sep) + len(entry) + (len(tail) + 2 if tail else 0) > width:
            break
        line += sep + entry
        shown += 1
    if shown < len(entries):
        line += (", " if shown else "") + rest(len(entries) - shown)
    return line if shown and len(line) <= width else None


def _item_line(prefix: str, item: Any, width: int) -> str:
    """An item as `prefix` and its fields, `path=value`, as many as fit in `width`."""
    cap = max(8, min(48, width // 3))
    if not (isinstance(item, dict) and item):
        return _clip(prefix + _value(item, max(cap, width - len(prefix))), width)
    line = prefix
    for n, (path, v) in enumerate(_fields(item)):
        part = f"{_clip(path, cap)}={_value(v, cap)}"
        if n and len(line) + 1 + len(part) > width:
            break
        line += (" " if n else "") + part
    return _clip(line, width)


def _hint(forms: list[Callable[[int], str]], room: int, worst: int
          ) -> Callable[[int], str]:
    """The richest hint whose longest rendering takes at most a third of `room`."""
    for form in forms:
        if len(form(worst)) + 1 <= room // 3:
            return form
    return forms[-1]


def _more_forms(key: str, path: str | None) -> list[Callable[[int], str]]:
    k = _json(key)
    where = f"{k}, path={_json(path)}" if path else k

    def more(n: int) -> str:
        return f"...{n} more — " if n else ""

    forms: list[Callable[[int], str]] = [
        lambda n: f"{more(n)}use recall({where}) or _transform to access full data",
        lambda n: f"{more(n)}recall({where})",
    ]
    if path:
        forms.append(lambda n: f"{more(n)}recall({k})")
    forms.append(lambda n: more(n).removesuffix(" — "))
    return forms


def _lines_size(lines: Iterable[str]) -> int:
    return sum(len(line) + 1 for line in lines)


def _array_section(values: list[Any], room: int, items: int) -> list[str]:
    """Schema and preview lines of an array, taking at most `room` characters (each
    line counted with the newline before it)."""
    lines: list[str] = []
    entries, complete = _schema(values)
    schema = _list_line("Schema: ", entries, min(room * 2 // 5, room) - 1, complete)
    if schema is not None:
        lines.append(schema)
        room -= len(schema) + 1
    for n in range(min(items, len(values)), 0, -1):
        title = f"Preview (first {n}):"
        width = (room - len(title) - 1) // n - 1
        if width >= _MIN_ITEM:
            lines.append(title)
            lines += [_item_line(f"[{i}] ", values[i], width) for i in range(n)]
            break
    return lines


def _array_preview(values: list[Any], key: str, room: int, items: int,
                   path: str | None = None, lines: list[str] | None = None) -> list[str]:
    lines = lines if lines is not None else [f"Type: Array({len(values)})"]
    room -= _lines_size(lines)
    hint = _hint(_more_forms(key, path), room, len(values))
    worst = hint(len(values))
    section = _array_section(values, room - len(worst) - 1, items)
    shown = sum(1 for line in section if line.startswith("["))
    tail = hint(len(values) - shown)
    return lines + section + ([tail] if tail else [])


def _focus(value: dict[Any, Any]) -> tuple[str, list[Any]] | None:
    """The array most of an object's size is in (following the largest member down
    through objects, three levels at most), with its JMESPath path."""
    path, node = "", value
    for _ in range(3):
        if not node:
            return None
        sizes = [(k, len(_encode(v))) for k, v in node.items()]
        name, size = max(sizes, key=lambda kv: kv[1])  # max keeps the first of equals
        if size * 2 < sum(s for _, s in sizes):
            return None
        path += ("." if path else "") + _segment(name)
        child = node[name]
        if isinstance(child, list):
            return (path, child) if child else None
        if not isinstance(child, dict):
            return None
        node = child
    return None


def _fields_line(value: dict[Any, Any], width: int) -> str | None:
    entries = [f"{_clip(_segment(k), 40)}={_value(v, 40)}"
               for k, v in itertools.islice(value.items(), _MAX_KEYS)]
    return _list_line("Fields: ", entries, width, len(value) <= _MAX_KEYS)


def _object_preview(value: dict[Any, Any], key: str, room: int, items: int) -> list[str]:
    lines = [f"Type: Object({_plural(len(value), 'key')})"]
    focus = _focus(value)
    if focus is not None:
        path, values = focus
        fields = _fields_line(value, (room - _lines_size(lines)) // 4)
        lines += [fields] if fields else []
        lines.append(_clip(f"At {path}: Array({len(values)})", max(room // 4, 20)))
        return _array_preview(values, key, room, items, path if len(path) <= 40 else None,
                              lines)
    room -= _lines_size(lines)
    hint = _hint(_more_forms(key, None), room, 0)(0)
    room -= _lines_size([hint]) if hint else 0
    entries, complete = _schema([value])
    schema = _list_line("Schema: ", entries, room * 2 // 5 - 1, complete)
    lines += [schema] if schema else []
    room -= _lines_size([schema]) if schema else 0
    fields = _fields_line(value, room - 1)
    lines += [fields] if fields else []
    return lines + ([hint] if hint else [])


def _text_preview(text: str, key: str, room: int) -> list[str]:
    lines = [f"Type: Text({len(text)} chars)"]
    room -= _lines_size(lines)
    if len(text) + 1 <= room:
        return [*lines, text]
    k = _json(key)
    forms: list[Callable[[int], str]] = [
        lambda at: f"use recall({k}, offset={at}) to read the omitted part",
        lambda at: f"recall({k}, offset={at})",
        lambda at: "",
    ]
    hint = _hint(forms, room, len(text))
    room -= len(hint(len(text))) + 1 if hint(len(text)) else 0
    marker_width = len(f"[... {len(text)} chars omitted ...]")
    content = max(0, room - marker_width - 3)  # three newlines: head, marker, tail
    head = content * 2 // 3
    tail = content - head
    first, last = text[:head], text[len(text) - tail:] if tail else ""
    # Whole lines where a line break is near: the break itself is shown by the join.
    cut = first.rfind("\n")
    first = first[:cut] if cut >= head // 2 else first
    cut = last.find("\n")
    last = last[cut + 1:] if 0 <= cut < tail // 2 else last
    omitted = len(text) - len(first) - len(last)
    marker = f"[... {omitted} chars omitted ...]"
    parts = [part for part in (first, marker, last) if part]
    hinted = hint(len(first))
    return lines + parts + ([hinted] if hinted else [])


def _scalar_preview(value: Any, room: int) -> list[str]:
    line = f"Type: {_type_name(value).capitalize()}"
    return [line, _clip(f"Value: {_json(value)}", room - len(line) - 2)]


# -- MCP content with binary blocks (actors/mcp_link.py's `tool_result` shape)

def _content_blocks(value: dict[Any, Any]) -> list[dict[str, Any]] | None:
    blocks = value.get("content")
    if isinstance(blocks, list) and blocks and \
            all(isinstance(b, dict) for b in blocks) and any(_binary(b) for b in blocks):
        return blocks
    return None


def _binary(block: dict[str, Any]) -> tuple[str, int, str] | None:
    """(mime type, decoded size, uri) of an image, audio or blob block."""
    if block.get("type") in ("image", "audio") and isinstance(block.get("data"), str):
        return str(block.get("mimeType", "?")), _b64_size(block["data"]), ""
    res = block.get("resource")
    if block.get("type") == "resource" and isinstance(res, dict) and \
            isinstance(res.get("blob"), str):
        return str(res.get("mimeType", "?")), _b64_size(res["blob"]), str(res.get("uri", ""))
    return None


def _b64_size(data: str) -> int:
    return len(data.rstrip("=")) * 3 // 4


def _block_line(block: dict[str, Any], width: int) -> str:
    binary = _binary(block)
    if binary is not None:
        mime, size, uri = binary
        line = f"Binary: {_clip(mime, 40)}, {size:,} bytes" + (f" ({uri})" if uri else "")
    elif block.get("type") == "text" and isinstance(block.get("text"), str):
        text = block["text"]
        line = f"Text({len(text)} chars) {_value(text, max(8, width // 2))}"
    elif isinstance(block.get("resource"), dict):
        res = block["resource"]
        line = f"Resource: {res.get('uri', '?')} {_value(res.get('text', ''), width // 2)}"
    elif block.get("type") == "resource_link":
        line = f"Link: {block.get('uri', '?')}"
    else:
        line = f"Block: {_clip(str(block.get('type', '?')), 40)}"
    return _clip(line, width)


def _content_preview(value: dict[str, Any], blocks: list[dict[str, Any]], key: str,
                     room: int) -> list[str]:
    if len(blocks) == 1 and len(value) == 1:
        return [_block_line(blocks[0], room - 1)]
    lines = [f"Type: Content({_plural(len(blocks), 'block')})"]
    room -= _lines_size(lines)
    hint = _hint(_more_forms(key, None), room, 0)(0)
    room -= _lines_size([hint]) if hint else 0
    extra = [_clip(f"{_segment(k)}: {_value(v, 40)}", room // 3)
             for k, v in itertools.islice(value.items(), 8) if k != "content"]
    extra = [line for line in extra if len(line) > 3]
    while extra and _lines_size(extra) > room // 3:
        extra.pop()
    room -= _lines_size(extra)
    width = max(20, min(room - 24, 200))
    shown: list[str] = []
    for i, block in enumerate(blocks):
        line = _clip(f"[{i}] {_block_line(block, width)}", width)
        rest = len(blocks) - i - 1
        reserve = len(f"...{rest} more blocks") + 1 if rest else 0
        if _lines_size([*shown, line]) + reserve > room:
            shown.append(f"...{len(blocks) - i} more blocks")
            break
        shown.append(line)
    return lines + shown + extra + ([hint] if hint else [])


# -- recall pages

def _page(container: list[Any] | dict[Any, Any], entries: Iterable[tuple[Any, Any]],
          offset: int, limit: int | None, budget: int, path: str | None) -> dict[str, Any]:
    """Items (of an array) or fields (of an object) from `offset`, as many as fit."""
    is_array = isinstance(container, list)
    total = len(container)
    start = min(offset, total)
    stop = total if limit is None else min(total, start + limit)
    chosen: list[tuple[Any, Any]] = []
    used = 2  # brackets or braces
    note = None
    for k, v in itertools.islice(entries, start, stop):
        size = len(_json(v)) + (0 if is_array else len(_json(str(k))) + 1)
        size += 1 if chosen else 0  # the comma
        if used + size <= budget:
            chosen.append((k, v))
            used += size
            continue
        if not chosen:
            name = str(k) if is_array else _clip(str(k), budget // 4)
            room = budget - 2 - (0 if is_array else len(_json(name)) + 1)
            chosen.append((name, _shrink(v, room)))
            where = _child(path, k, is_array)
            note = (f"{'item' if is_array else 'field'} {_clip(str(k), 40)} is "
                    f"{size:,} characters, over the budget of {budget}, so it is shortened "
                    "here" + (f"; page through it with path={_json(where)}"
                              if len(where) <= 120 else ""))
        break
    count = len(chosen)
    page: dict[str, Any] = {"type": "array" if is_array else "object", "offset": start,
                            "count": count, "total": total}
    if is_array:
        page["items"] = [v for _, v in chosen]
    else:
        page["fields"] = dict(chosen)
    page["next_offset"] = start + count if start + count < total else None
    if note is not None:
        page["note"] = note
    return page


def _child(path: str | None, key: Any, is_array: bool) -> str:
    step = f"[{key}]" if is_array else _segment(key)
    if path is None:
        return step
    base = path if _SIMPLE_PATH.fullmatch(path) else f"({path})"
    return base + step if is_array else f"{base}.{step}"


_SHRINK_STEPS = ((400, 20, 6), (120, 8, 4), (40, 4, 3), (16, 2, 2), (8, 1, 1))


def _shrink(value: Any, width: int) -> Any:
    """`value` shortened until its compact JSON is at most `width` characters: strings
    clipped, arrays and objects cut (a last string or key "…" says how much), nesting
    cut to kind and size; at worst its JSON text, clipped, as a string."""
    for chars, count, depth in _SHRINK_STEPS:
        shrunk = _cut(value, chars, count, depth)
        if len(_json(shrunk)) <= width:
            return shrunk
    text = _json(value)
    n = min(len(text), width)
    while n > 0:
        clipped = text[:n] + "…"
        over = len(_json(clipped)) - width
        if over <= 0:
            return clipped
        n -= over
    return "…"


def _cut(value: Any, chars: int, count: int, depth: int) -> Any:
    if isinstance(value, str):
        return _clip(value, chars)
    if isinstance(value, list):
        if depth == 0 and value:
            return _kind(value)
        out = [_cut(v, chars, count, depth - 1) for v in value[:count]]
        return out + ([f"… +{len(value) - count} more"] if len(value) > count else [])
    if isinstance(value, dict):
        if depth == 0 and value:
            return _kind(value)
        cut: dict[str, Any] = {}
        for k, v in itertools.islice(value.items(), count):
            cut.setdefault(_clip(str(k), chars), _cut(v, chars, count, depth - 1))
        if len(value) > count:
            cut["…"] = f"+{len(value) - count} more keys"
        return cut
    return value
