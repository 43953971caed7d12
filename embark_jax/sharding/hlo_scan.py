"""Which instructions of an optimized HLO module read or write a whole buffer: a value of
the per-device shape and dtype of a table, an optimizer slot or another large array we name.

A compiled train step that updates its tables in place touches each table only through the
kernels that read or write just the rows their ids name (`ROW_KERNELS`: the lookup, the
in-place undoable update, the undo) and ops that move no bytes (parameters, bitcasts,
tuples); anything else that produces a value of a table's shape (a `copy`, a fusion whose
root is a copy, an elementwise pass, a scatter) or takes one as an operand (a reduction over
the table, e.g. a finiteness check) costs a pass over the whole table per step. `scan`
lists those instructions from `compiled.as_text()`; it reads text only (no JAX).

Shapes are compared with their size-1 dimensions dropped, since a `[1, rows, width]` shard
is bitcast to `[rows, width]` inside `shard_map`. Fusion bodies and reducer regions are not
scanned (the fusion instruction itself is, with its root op named), so each buffer-producing
instruction is listed once.
"""

from __future__ import annotations

import dataclasses
import re

# Ops that produce no new buffer: they alias or forward their operands.
PASS_THROUGH = frozenset(
    {
        "parameter",
        "bitcast",
        "get-tuple-element",
        "tuple",
        "while",
        "conditional",
        "call",
        "opt-barrier",
        "copy-done",  # its copy-start is listed
    }
)
# Our kernels that take a whole table but read or write only the rows their ids name (the
# update kernels' table and slot results alias their operands: in place).
ROW_KERNELS = frozenset(
    {
        "embark_lookup_pool",
        "embark_sparse_grad_stage",
        "embark_commit_rows",
        "embark_sparse_grad_update",
        "embark_sparse_update",
        "embark_hash_find",
        "embark_hash_find_or_insert",
    }
)
COPY_OPS = frozenset({"copy", "copy-start"})

# numpy / JAX dtype names -> HLO element types
HLO_DTYPES = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float64": "f64",
    "int32": "s32",
    "int64": "s64",
    "int16": "s16",
    "uint32": "u32",
    "uint64": "u64",
    "uint16": "u16",
    "uint8": "u8",
    "int8": "s8",
    "bool": "pred",
    "complex64": "c64",
    "complex128": "c128",
}

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8\w*|c64|c128)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?(?P<name>[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instr:
    computation: str
    name: str
    opcode: str
    shape: str  # the result's shape text (a tuple for multi-output ops)
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each array result
    line: str
    is_root: bool


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape text, the remainder starting at the opcode) of an instruction's right side."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def parse(hlo_text: str) -> dict[str, list[Instr]]:
    """Computation name -> its instructions, from HLO text."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m["name"]
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        ins = instruction(line, current)
        if ins is not None:
            comps[current].append(ins)
    return comps


def instruction(line: str, computation: str = "") -> Instr | None:
    """One HLO instruction line parsed (None if the line is not one)."""
    m = _INSTR.match(line)
    if not m:
        return None
    shape, tail = _split_shape(m["rest"])
    op = _OPCODE.match(tail)
    arrays = tuple(
        (a["dtype"], tuple(int(x) for x in a["dims"].split(",") if x))
        for a in _ARRAY.finditer(shape)
    )
    return Instr(
        computation, m["name"], op["op"] if op else "?", shape, arrays, line, bool(m["root"])
    )


def squeeze(dims) -> tuple[int, ...]:
    return tuple(int(d) for d in dims if int(d) != 1)


def buffer_keys(buffers: dict[str, tuple[str, tuple[int, ...]]]) -> dict[tuple, list[str]]:
    """`{name: (dtype, per-device shape)}` -> `{(hlo dtype, squeezed shape): [names]}`."""
    keys: dict[tuple, list[str]] = {}
    for name, (dtype, shape) in buffers.items():
        key = (HLO_DTYPES.get(str(dtype), str(dtype)), squeeze(shape))
        keys.setdefault(key, []).append(name)
    return keys


def _operands(ins: Instr) -> list[str]:
    """Names of the instruction's operands (inside the opcode's parentheses)."""
    start = ins.line.find(f"{ins.opcode}(")
    if start < 0:
        return []
    depth, end = 0, len(ins.line)
    for i in range(start + len(ins.opcode), len(ins.line)):
        depth += ins.line[i] == "("
        depth -= ins.line[i] == ")"
        if depth == 0:
            end = i
            break
    return [m["name"] for m in _OPERAND.finditer(ins.line[start:end])]


def scan(hlo_text: str, buffers: dict[str, tuple[str, tuple[int, ...]]]) -> list[dict]:
    """Instructions outside fusion bodies whose result (or a tuple element of it) has the
    dtype and shape of one of `buffers` (`{name: (dtype, per-device shape)}`), or which take
    such a value as an operand, other than pass-through ops and `ROW_KERNELS`. Each entry:
    `computation`, `name`, `opcode`, `root` (a fusion's root opcode, else None), `shape`,
    `buffers` (the names it matches), `reads` (only an operand matches) and `copy` (a copy,
    a copy-start, or a fusion whose root is a copy)."""
    keys = buffer_keys(buffers)
    comps = parse(hlo_text)
    called = {
        m["name"] for instrs in comps.values() for i in instrs for m in _CALLS.finditer(i.line)
    }
    roots = {c: next((i.opcode for i in instrs if i.is_root), None) for c, instrs in comps.items()}

    def matches(ins: Instr) -> list[str]:
        return sorted({n for a in ins.arrays for n in keys.get((a[0], squeeze(a[1])), [])})

    found = []
    for comp, instrs in comps.items():
        if comp in called:  # a fusion body or a reducer: its fusion instruction is scanned
            continue
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            if ins.opcode in PASS_THROUGH:
                continue
            if ins.opcode == "custom-call":
                t = _TARGET.search(ins.line)
                if t and t["target"] in ROW_KERNELS:
                    continue
            names = matches(ins)
            read = sorted({n for o in _operands(ins) if o in by_name for n in matches(by_name[o])})
            if not names and not read:
                continue
            root = None
            if ins.opcode == "fusion":
                m = _CALLS.search(ins.line)
                root = roots.get(m["name"]) if m else None
            found.append(
                {
                    "computation": comp,
                    "name": ins.name,
                    "opcode": ins.opcode,
                    "root": root,
                    "shape": ins.shape,
                    "buffers": names or read,
                    "reads": not names,
                    "copy": ins.opcode in COPY_OPS or root in COPY_OPS,
                }
            )
    return found


def summary(found: list[dict], limit: int = 40) -> dict:
    """A JSON-sized report of `scan`'s result: counts and the first `limit` entries."""
    copies = [f for f in found if f["copy"]]
    return {
        "count": len(found),
        "copies": len(copies),
        "copied_buffers": sorted({b for f in copies for b in f["buffers"]}),
        "ops": found[:limit],
    }
