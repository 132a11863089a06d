"""Policy: the compute dtype, the category of every primitive, and region rules, as data."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import fnmatch
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jamp.casting import oplists
from jamp.casting.dtypes import (
    DTYPE_NAMES,
    ELIGIBLE_DTYPES,
    FLOAT32,
    LOW_DTYPES,
    checked_reduce_dtype,
    is_eligible,
    parse_dtype,
)


class Mode(enum.StrEnum):
    """How the equations inside a region are evaluated (a str, so region rules can be written as strings)."""

    AUTOCAST = "autocast"  # the policy's per-primitive categories (the mode outside any region rule)
    FLOAT32 = "float32"  # every floating op in float32
    FLOAT32_OUTPUT = "float32_output"  # as autocast, but matmuls emit their float32 accumulator (attention logits)
    COMPUTE = "compute"  # every floating op in the compute dtype (linear algebra excepted)
    NATIVE = "native"  # like one unlisted op: no casts beyond what keeps the program well-typed
    OFF = "off"  # the original program: inputs cast back to the dtypes the jaxpr recorded


MODES = tuple(Mode)


class RegionRule(NamedTuple):
    """``pattern`` is a glob over a name-stack path ("Block_0/LayerNorm_0") or one component of it.

    Path components are name scopes, flax module names and the names of jit-wrapped functions
    (``log_softmax``, ``softplus``...), so one rule form covers all three. Innermost match wins.
    """

    pattern: str
    mode: Mode
    why: str = ""

    def matches(self, path: str, component: str) -> bool:
        return fnmatch.fnmatchcase(component, self.pattern) or fnmatch.fnmatchcase(path, self.pattern)


def _check_mode(mode: str, where: str) -> Mode:
    if mode not in MODES:
        raise ValueError(f"{where}: region mode {mode!r} is not one of {[str(m) for m in MODES]}")
    return Mode(mode)


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """What :func:`jamp.autocast` does, as data: the compute dtype, the category of every primitive, region rules.

    Immutable and hashable (a jit static argument, a cache key). Build one with :func:`get_policy` or by
    adjusting a built-in with the ``with_*`` methods, and pass it as ``jamp.autocast(fn, policy=...)``:

    ```python
    jamp.get_policy("gpu").with_rules({"*lm_head*": "float32"})
    ```

    Attributes:
        compute_dtype: the dtype of ``lower`` ops (matmuls, convolutions): float16 or bfloat16 (a dtype or
            a name such as "bf16").
        device_type: whose op lists the categories follow: "gpu", "cpu" or "tpu" (TPU takes the GPU lists).
        categories: ``(primitive name, category)`` pairs (sorted by name in the built-in policies). A category
            is one of "lower", "float32", "linalg", "promote", "passthrough" (see :mod:`jamp.casting.oplists`);
            a primitive not listed is "default": it runs on the dtypes it was traced with.
        rules: region rules ``RegionRule(pattern, mode, why)``: a glob over a name-stack path
            ("Block_0/LayerNorm_0") or one component of it (a name scope, a flax module name, the name of a
            jit-wrapped function) and the mode of the equations inside ("autocast", "float32",
            "float32_output", "compute", "native", "off"). The innermost matching region wins; of rules
            matching the same region, the later one (so rules added by :meth:`with_rules` override the
            built-in ones).
        output_dtype: the dtype autocast's floating outputs are cast to (float16, bfloat16 or float32); None
            keeps the dtypes the function declares.
        param_dtype: the dtype :meth:`cast_to_param` casts to (jmp's ``param_dtype``); float32 by default.
        fp8: whether eligible matmuls of ``lower`` ops run in float8 with current scaling
            (:mod:`jamp.casting.fp8`).
        reduce_dtype: the dtype of the gradients of float32 matmul operands as the backward matmul produces
            them, and so as they cross devices: float32 (as torch DDP reduces ``.grad``) or the compute dtype.

    Examples:
        >>> import jax.numpy as jnp, jamp
        >>> policy = jamp.get_policy("gpu").with_rules({"*lm_head*": "float32"})
        >>> policy.compute_dtype, policy.category("dot_general"), policy.category("exp")
        (dtype('float16'), <Category.LOWER: 'lower'>, <Category.FLOAT32: 'float32'>)
        >>> policy.match("Model/lm_head", "lm_head")  # the region mode there
        <Mode.FLOAT32: 'float32'>
        >>> policy.cast_to_compute({"w": jnp.ones(2), "step": jnp.arange(2)})
        {'step': Array([0, 1], dtype=int32), 'w': Array([1., 1.], dtype=float16)}
    """

    compute_dtype: np.dtype
    device_type: str = "gpu"
    categories: tuple[tuple[str, oplists.Category], ...] = ()
    rules: tuple[RegionRule, ...] = ()
    output_dtype: np.dtype | None = None
    param_dtype: np.dtype = FLOAT32
    fp8: bool = False  # eligible matmuls of `lower` ops run in float8 (jamp.casting.fp8)
    reduce_dtype: np.dtype = FLOAT32  # cotangents of wider matmul operands (jamp.casting.wide_cotangents)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("compute_dtype", parse_dtype(self.compute_dtype, "compute_dtype"))
        set_("reduce_dtype", checked_reduce_dtype(self.reduce_dtype, self.compute_dtype))
        if self.output_dtype is not None:
            set_("output_dtype", parse_dtype(self.output_dtype, "output_dtype", ELIGIBLE_DTYPES))
        set_("param_dtype", parse_dtype(self.param_dtype, "param_dtype", ELIGIBLE_DTYPES))
        if self.device_type not in oplists.DEVICE_TYPES:
            raise ValueError(f"device_type={self.device_type!r} is not supported; allowed: {oplists.DEVICE_TYPES}")
        for prim, cat in self.categories:
            if cat not in oplists.CATEGORIES:
                raise ValueError(f"categories[{prim!r}]={cat!r} is not one of {[str(c) for c in oplists.CATEGORIES]}")
        set_("categories", tuple((prim, oplists.Category(cat)) for prim, cat in self.categories))
        rules = [RegionRule(*r) for r in self.rules]
        set_("rules", tuple(r._replace(mode=_check_mode(r.mode, f"rule {r.pattern!r}")) for r in rules))
        set_("_category_of", dict(self.categories))
        if not isinstance(self.fp8, (bool, np.bool_)):
            raise TypeError(f"fp8={self.fp8!r} must be a bool")
        set_("fp8", bool(self.fp8))
        set_(
            "_key",
            (
                self.compute_dtype,
                self.device_type,
                self.categories,
                self.rules,
                self.output_dtype,
                self.param_dtype,
                self.fp8,
                self.reduce_dtype,
            ),
        )
        set_("_hash", hash(self._key))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key == other._key

    def __repr__(self) -> str:
        return (
            f"Policy(device_type={self.device_type!r}, compute_dtype={self.compute_dtype.name}, "
            f"output_dtype={getattr(self.output_dtype, 'name', None)}, rules={len(self.rules)}"
            f"{', fp8=True' if self.fp8 else ''}"
            f"{'' if self.reduce_dtype == FLOAT32 else f', reduce_dtype={self.reduce_dtype.name}'})"
        )

    def category(self, primitive_name: str) -> oplists.Category:
        """The category of a primitive; unlisted primitives are ``default`` (recorded dtypes)."""
        return self._category_of.get(primitive_name, oplists.Category.DEFAULT)

    def match(self, path: str, component: str) -> Mode | None:
        """The mode of the last rule matching this path (later rules override earlier ones)."""
        mode = None
        for rule in self.rules:
            if rule.matches(path, component):
                mode = rule.mode
        return mode

    # -- derived policies -----------------------------------------------------------------------
    def with_compute_dtype(self, dtype: Any) -> Policy:
        """The same policy with another compute dtype (float16 or bfloat16)."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_reduce_dtype(self, dtype: Any) -> Policy:
        """The same policy, the gradients of float32 matmul operands in ``dtype`` (float32 or the compute dtype)."""
        return dataclasses.replace(self, reduce_dtype=dtype)

    def with_fp8(self, enabled: bool = True) -> Policy:
        """Run eligible matmuls in float8 with current scaling (see the fp8 page of the docs)."""
        return dataclasses.replace(self, fp8=enabled)

    def with_rules(self, rules: Mapping[str, str] | None = None, /, **more: str) -> Policy:
        """Add region rules ``{pattern: mode}``; they override the built-in ones."""
        added = {**(rules or {}), **more}
        return dataclasses.replace(self, rules=self.rules + tuple(RegionRule(p, m) for p, m in added.items()))

    def with_categories(self, categories: Mapping[str, str]) -> Policy:
        """Override the category of some primitives, e.g. ``{"exp": "passthrough"}``."""
        merged = {**self._category_of, **categories}
        return dataclasses.replace(self, categories=tuple(sorted(merged.items())))

    # -- jmp-style casting helpers for parameters and outputs -------------------------------------
    def cast_to_compute(self, tree: Any) -> Any:
        """``tree`` with its float16/bfloat16/float32 leaves cast to ``compute_dtype`` (jmp's helper); other
        leaves (integers, float64, PRNG keys) as they are."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """``tree`` with its float16/bfloat16/float32 leaves cast to ``param_dtype`` (jmp's helper)."""
        return _cast_floats(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """``tree`` with its float16/bfloat16/float32 leaves cast to ``output_dtype``; ``tree`` itself when that
        is None (jmp's helper)."""
        return tree if self.output_dtype is None else _cast_floats(tree, self.output_dtype)


def _cast_floats(tree: Any, dtype: np.dtype) -> Any:
    def leaf(x):
        return x.astype(dtype) if hasattr(x, "dtype") and is_eligible(x.dtype) else x

    return jax.tree.map(leaf, tree)


def builtin_policy(device_type: str, dtype: Any = None) -> Policy:
    """The seed's op lists for ``device_type`` ("gpu"/"cuda", "cpu", "tpu")."""
    device = oplists.DEVICE_ALIASES.get(device_type) if isinstance(device_type, str) else None
    if device is None:
        raise ValueError(
            f"device_type={device_type!r} is not supported; allowed: "
            f"{sorted(oplists.DEVICE_ALIASES)} or None (jax.default_backend())"
        )
    oplist = oplists.OPLIST_OF_DEVICE[device]
    rules = tuple(RegionRule(p, m, w) for p, m, w in oplists.JIT_RULES[oplist] + oplists.SCOPE_RULES[oplist])
    return Policy(
        compute_dtype=oplists.DEFAULT_DTYPE_OF_DEVICE[device] if dtype is None else dtype,
        device_type=device,
        categories=tuple(sorted(oplists.categories_for(oplist).items())),
        rules=rules,
    )


def default_device_type() -> str:
    return oplists.DEVICE_ALIASES.get(jax.default_backend(), "gpu")


_KEY_ALIASES = {
    "p": "params",
    "param": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "d": "device",
    "device": "device",
}
# name -> (device, compute dtype, fp8); "fp8": float8 matmuls, every other op as the bfloat16 GPU policy
_NAMED = {
    "mixed_float16": ("gpu", "float16", False),
    "mixed_bfloat16": (None, "bfloat16", False),
    "fp8": ("gpu", "bfloat16", True),
}
# The names a policy string may be, without "=": (what they are, the names).
_NAME_FORMS = (
    ("a device name", tuple(sorted(oplists.DEVICE_ALIASES))),
    ("a named policy", tuple(sorted(_NAMED))),
    ("a compute dtype", tuple(sorted(k for k, v in DTYPE_NAMES.items() if np.dtype(v) in LOW_DTYPES))),
)


def _unknown_name(spec: str, text: str) -> ValueError:
    forms = "; ".join(f"{what} ({', '.join(map(repr, names))})" for what, names in _NAME_FORMS)
    close = difflib.get_close_matches(text, [n for _, names in _NAME_FORMS for n in names], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(
        f"policy {spec!r} is not a policy name. A policy string is {forms}; or jmp's key list such "
        f"as 'p=f32,c=bf16,o=f32' with keys {sorted(_KEY_ALIASES)}.{hint}"
    )


def get_policy(spec: str | Policy, *, device_type: str | None = None) -> Policy:
    """Parse a policy string into a :class:`jamp.Policy` (or pass a Policy through).

    Accepted forms: a device name (``"gpu"``, ``"cuda"``, ``"cpu"``, ``"tpu"``), Keras' names
    (``"mixed_float16"``, ``"mixed_bfloat16"``), ``"fp8"`` (the GPU lists in bfloat16 with float8
    matmuls), a bare dtype (``"bf16"``), or jmp's key list
    ``"p=f32,c=bf16,o=f32"`` with keys ``p/params``, ``c/compute``, ``o/output`` and ``d/device``.
    The result is the built-in op lists of the device, in the compute dtype given (else the device's
    default: float16 on a GPU, bfloat16 on a CPU or TPU).

    Args:
        spec: a policy string in one of the forms above (case and surrounding spaces do not matter), or a
            :class:`jamp.Policy`, returned as it is.
        device_type: the device whose op lists a string that names none takes ("gpu", "cuda", "cpu",
            "tpu"); None means ``jax.default_backend()``.

    Returns:
        The :class:`jamp.Policy`.

    Raises:
        ValueError: for a string in none of the forms (the error lists them and suggests the closest name),
            a key given twice, an unknown device, or compute dtype float32 (no mixed precision: use
            ``jamp.autocast(..., enabled=False)``).
        TypeError: for a ``spec`` that is neither a string nor a Policy.

    Examples:
        >>> import jamp
        >>> policy = jamp.get_policy("mixed_bfloat16", device_type="cpu")
        >>> policy.device_type, policy.compute_dtype
        ('cpu', dtype(bfloat16))
        >>> jamp.get_policy("p=f32,c=bf16,o=f32", device_type="tpu").output_dtype
        dtype('float32')
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"policy must be a jamp.Policy or a policy string, got {type(spec).__name__}")
    text = spec.strip().lower()
    fields: dict[str, str] = {}
    fp8 = False
    if text in oplists.DEVICE_ALIASES:
        fields["device"] = text
    elif text in _NAMED:
        device, fields["compute"], fp8 = _NAMED[text]
        if device:
            fields["device"] = device
    elif "=" not in text:
        if text not in DTYPE_NAMES:
            raise _unknown_name(spec, text)
        fields["compute"] = text
    else:
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in _KEY_ALIASES:
                raise ValueError(
                    f"policy {spec!r}: cannot parse {item!r}; expected key=value with keys {sorted(_KEY_ALIASES)}"
                )
            if _KEY_ALIASES[key] in fields:
                raise ValueError(f"policy {spec!r}: key {_KEY_ALIASES[key]!r} given twice; give each key once")
            fields[_KEY_ALIASES[key]] = value
    device = fields.get("device") or device_type or default_device_type()
    compute = fields.get("compute")
    if compute is not None and parse_dtype(compute, "policy compute dtype", (*LOW_DTYPES, FLOAT32)) == FLOAT32:
        raise ValueError(
            f"policy {spec!r}: compute dtype float32 means no mixed precision; "
            "use autocast(enabled=False) instead, or one of float16, bfloat16"
        )
    policy = builtin_policy(device, compute)
    return dataclasses.replace(
        policy,
        output_dtype=fields.get("output"),
        param_dtype=fields.get("params", FLOAT32),
        fp8=fp8,
    )
