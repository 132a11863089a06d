"""What the backward pass recomputes instead of keeping: autocast's rewrite, made lighter to differentiate.

After the interpreter rewrites a jaxpr (each body of it included), two kinds of values are rebuilt in the
backward pass instead of being saved for it, each by a ``jax.checkpoint`` that saves nothing inside:

- islands: the elementwise ops and reductions that lie between the same matmuls and are connected to each
  other (a norm, a softmax, an activation, a loss) keep only their inputs; the values inside, the float32
  values of float32-policy ops among them, are recomputed from those where the backward pass needs them;
- casts at use: a float32 input of a jaxpr (a parameter, a scan's slice of stacked parameters) that is cast
  to the compute dtype for a matmul is cast again in the backward pass, so no low-precision copy of the
  parameters is saved, and a scan over layers keeps none of the stacked parameters.

The forward pass binds the same equations in the same dtypes: an autocast function returns the same bits
with and without this. Under ``jax.grad`` XLA fuses the forward pass differently once fewer of its values
are kept, and a backend that computes float16/bfloat16 ops in float32 within a fusion (XLA's default
"excess precision") may round the primal values differently: a difference at the compute dtype's rounding.
``jamp.autocast(fn, recompute=False)`` keeps every value, as JAX does by default.
"""

from __future__ import annotations

import functools
import heapq

import jax
import numpy as np

from jamp import _jax_compat as jc
from jamp.casting.dtypes import FLOAT32, is_low

# First-order primitives cheap to run again in the backward pass: elementwise ops, reductions, broadcasts.
CHEAP = frozenset(
    """
    abs add and atan2 broadcast_in_dim cast_on_shard cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq erf
    erf_inv erfc exp exp2 expand_dims expm1 floor ge gt integer_pow iota is_finite le log log1p logistic lt max
    min mul ne neg not or pow reduce_and reduce_max reduce_min reduce_or reduce_precision reduce_prod reduce_sum
    rem reshape round rsqrt select_n sign sin sinh sqrt square squeeze stop_gradient sub tan tanh xor
    """.split()
)
# Cheap primitives whose derivative reads no value of the forward pass: an island of these alone saves nothing.
_LINEAR = frozenset(
    """
    add and broadcast_in_dim cast_on_shard convert_element_type copy copy_p eq expand_dims ge gt iota le lt ne neg not or
    reduce_precision reduce_sum reshape squeeze stop_gradient sub xor
    """.split()
)
# wide_matmul: a dot_general whose wider operands' gradients come out in reduce_dtype (jamp.casting.wide_cotangents)
_MATMULS = ("dot_general", "conv_general_dilated", "wide_matmul")
# ``jax.ad_checkpoint.checkpoint_name``'s primitive: a value the user named for a remat policy. Its readers stay out
# of islands, so that the value reaches the backward pass as the name's output (JAX's residual printer and an
# outer ``save_only_these_names`` policy see the user's name, not a checkpoint's output).
_CHECKPOINT_NAME = "name"
_checkpoint = functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)


@jc.weakref_lru_cache
def _all_cheap(jaxpr: jc.Jaxpr) -> bool:
    return not jaxpr.effects and all(_is_cheap(e) for e in jaxpr.eqns)


def _is_cheap(eqn) -> bool:
    if eqn.primitive.name in CHEAP:
        return True
    body = jc.call_body(eqn)
    return body is not None and _all_cheap(body)


def _is_nonlinear(eqn) -> bool:
    body = jc.call_body(eqn)
    if body is not None:
        return any(_is_nonlinear(e) for e in body.eqns)
    name, literal = eqn.primitive.name, [isinstance(v, jc.Literal) for v in eqn.invars]
    if (name == "mul" and any(literal)) or (name == "div" and literal[1]):  # scaling by a constant (a mean)
        return False
    return name not in _LINEAR


def _cast_of_input(eqn, inputs: set) -> bool:
    """A float32 input of the jaxpr cast to a low dtype (a parameter cast for a matmul)."""
    x = eqn.invars[0] if eqn.invars else None
    return (
        eqn.primitive.name in ("convert_element_type", "cast_on_shard")
        and isinstance(x, jc.Var)
        and x in inputs
        and x.aval.dtype == FLOAT32
        and is_low(eqn.outvars[0].aval.dtype)
    )


def islands(jaxpr: jc.Jaxpr, inputs: set) -> list[list[int]]:
    """The islands of ``jaxpr`` (lists of equation indices) worth recomputing: those with a nonlinear op.

    An island is the cheap equations that are connected to each other and share a stage (the most non-cheap
    equations on any path from the inputs to them). A path that left an island through a matmul would
    reach a later stage, and one through cheap equations would join them to it: no path leaves an island
    and comes back, so it can run as one call."""
    producer: dict = {}
    stage: list[int] = []
    parent = list(range(len(jaxpr.eqns)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    named = {v for e in jaxpr.eqns if e.primitive.name == _CHECKPOINT_NAME for v in e.outvars}
    cheap = [
        _is_cheap(e)
        and not _cast_of_input(e, inputs)
        and not any(isinstance(v, jc.Var) and v in named for v in e.invars)
        for e in jaxpr.eqns
    ]
    for i, eqn in enumerate(jaxpr.eqns):
        preds = [producer[v] for v in eqn.invars if isinstance(v, jc.Var) and v in producer]
        stage.append(max((stage[p] + (not cheap[p]) for p in preds), default=0))
        for p in preds:
            if cheap[i] and cheap[p] and stage[p] == stage[i]:
                parent[find(p)] = find(i)
        producer.update(dict.fromkeys(eqn.outvars, i))
    found: dict[int, list[int]] = {}
    for i in range(len(jaxpr.eqns)):
        if cheap[i]:
            found.setdefault(find(i), []).append(i)
    return [g for g in found.values() if any(_is_nonlinear(jaxpr.eqns[i]) for i in g)]


class _Group:
    """Equations that run as one checkpointed call: ``eqns`` on ``ins``, returning ``outs``."""

    def __init__(self, eqns: list, ins: list, outs: list):
        self.eqns, self.ins, self.outs = eqns, ins, outs
        self.scopes = jc.common_scopes(eqns)  # name scopes all of them share: the call enters them

    def key(self) -> tuple | None:
        """What makes two groups the same computation (their structure, parameters and input types), or None."""
        index = {v: i for i, v in enumerate(self.ins)}
        items = []
        for e in self.eqns:
            refs = tuple(index[v] if isinstance(v, jc.Var) else _literal_key(jc.literal_value(v)) for v in e.invars)
            index.update((v, len(index)) for v in e.outvars)
            where = (jc.scopes(e, self.scopes), jc.source_lines(e))  # a group binds its own equations' sources
            items.append((e.primitive, tuple(sorted(e.params.items())), refs, where))
        key = (tuple(v.aval for v in self.ins), tuple(items), tuple(index[v] for v in self.outs))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def __call__(self, *args) -> list:
        env = dict(zip(self.ins, args))
        jc.run(self.eqns, env, scopes=self.scopes)
        return [jc.read(env, v) for v in self.outs]


def _literal_key(value) -> tuple:
    array = np.asarray(value)
    return (type(value), array.dtype, array.tobytes())


@functools.lru_cache(maxsize=4096)
def _first(key: tuple) -> list:
    """Holds the first group seen with ``key``."""
    return []


def _shared(group: _Group) -> _Group:
    """The first group of the same structure: the same function, so ``jax.checkpoint`` traces it once and
    JAX differentiates it once for every layer that repeats it."""
    key = group.key()
    if key is None:
        return group
    first = _first(key)
    if not first:
        first.append(group)
    return first[0]


def _groups(jaxpr: jc.Jaxpr) -> tuple[list[list[int]], dict]:
    """The islands, then one group per matmul that reads a cast input (it casts the float32 input itself),
    and the casts of inputs by their outputs."""
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    casts = {e.outvars[0]: e for e in jaxpr.eqns if _cast_of_input(e, inputs)}
    groups = islands(jaxpr, inputs)
    groups += [
        [i]
        for i, e in enumerate(jaxpr.eqns)
        if e.primitive.name in _MATMULS and any(isinstance(v, jc.Var) and v in casts for v in e.invars)
    ]
    return groups, casts


def _group(jaxpr: jc.Jaxpr, members: list[int], casts: dict, readers: dict, node: tuple) -> _Group:
    """The call of ``members``: its inputs (a cast input read by a matmul: the float32 input, cast inside),
    and its outputs that others read."""
    eqns = [jaxpr.eqns[i] for i in members]
    defined = {v for e in eqns for v in e.outvars}
    pre, ins = [], []
    for e in eqns:
        for v in e.invars:
            if not isinstance(v, jc.Var) or v in defined:
                continue
            if v in casts and e.primitive.name in _MATMULS:
                pre.append(casts[v])
                v = casts[v].invars[0]
            ins.append(v)
    final = {v for v in jaxpr.outvars if isinstance(v, jc.Var)}
    made = dict.fromkeys(v for e in eqns for v in e.outvars)
    outs = [v for v in made if v in final or readers.get(v, {node}) - {node}]
    return _Group(list(dict.fromkeys(pre)) + eqns, list(dict.fromkeys(ins)), outs)


def _order(nodes: list, reads: dict, made: dict, node_of: list) -> list:
    """``nodes`` (equations and groups) in an order where each comes after what it ``reads`` (``made``: the
    node that makes a variable), as close to the jaxpr's as that allows."""
    first: dict = {}
    for i, nd in enumerate(node_of):
        first.setdefault(nd, i)
    deps = {nd: {made[v] for v in reads[nd] if isinstance(v, jc.Var) and v in made} - {nd} for nd in nodes}
    users: dict = {nd: [] for nd in nodes}
    for nd, ds in deps.items():
        for d in ds:
            users[d].append(nd)
    waiting = {nd: len(ds) for nd, ds in deps.items()}
    ready = [(first[nd], nd) for nd in nodes if not waiting[nd]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, nd = heapq.heappop(ready)
        order.append(nd)
        for u in users[nd]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (first[u], u))
    return order


def with_recompute(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """``closed`` with its islands and casts at use each in a ``jax.checkpoint`` that saves nothing inside
    (``closed`` itself where there is nothing to recompute, or where effects fix the equations' order)."""
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return closed
    members, casts = _groups(jaxpr)
    if not members:
        return closed
    owner = {i: ("group", g) for g, group in enumerate(members) for i in group}
    node_of = [owner.get(i, ("eqn", i)) for i in range(len(jaxpr.eqns))]
    readers: dict = {}
    read_by: dict = {}  # variable -> the primitives that read it
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if isinstance(v, jc.Var):
                readers.setdefault(v, set()).add(node_of[i])
                read_by.setdefault(v, set()).add(e.primitive.name)
    final = {v for v in jaxpr.outvars if isinstance(v, jc.Var)}
    # a cast that only matmuls read: each of them casts again in its own group
    unread = {
        ("eqn", i)
        for i, e in enumerate(jaxpr.eqns)
        if casts.get(e.outvars[0] if e.outvars else None) is e
        and e.outvars[0] not in final
        and read_by.get(e.outvars[0], set()) <= set(_MATMULS)
    }
    groups = [_group(jaxpr, m, casts, readers, ("group", g)) for g, m in enumerate(members)]
    nodes = list(dict.fromkeys(node_of))
    reads = {nd: groups[nd[1]].ins if nd[0] == "group" else jaxpr.eqns[nd[1]].invars for nd in nodes}
    made = {v: node_of[i] for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    order = _order(nodes, reads, made, node_of)

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        for kind, k in order:
            if (kind, k) in unread:
                continue
            if kind == "eqn":
                jc.run([jaxpr.eqns[k]], env)
            else:
                group = groups[k]
                with jc.scoped_context(group.eqns[0], 0, group.scopes):
                    outs = _checkpoint(_shared(group))(*[jc.read(env, v) for v in group.ins])
                env.update(zip(group.outs, outs))
        return [jc.read(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*closed.in_avals)
