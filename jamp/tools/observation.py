"""What a tool hooked into the interpreter keeps: the scopes around an equation, and a frame per evaluation.

``jamp.explain`` and ``jamp.find_overflow`` are *observers*: their hook on the interpreter's loop
(:mod:`jamp.tools.bodies`) calls ``observer.record(call, effective, outs, frame, whole)`` after every equation,
and evaluates the bodies of higher-order primitives itself (:mod:`jamp.tools.entering`), so that the observer
sees every equation inside them (as jax's checkify threads its error through loop carries and branch outputs).
Autocast's rules and contexts know nothing of observers.

- :class:`Scope`: a loop, branch or shard_map around an equation, kept in the frame of its body.
- :class:`Frame`: one evaluation of a jaxpr. A *threading* observer (find_overflow) keeps a *shadow*
  beside every value there (the float32 program's value) and *reports*: int32 vectors computed inside
  a body that must leave it, ``[found, *levels, *payload]`` where ``found`` is nonzero where the report
  found something and ``levels`` gets one index per loop or shard_map the report has left (the
  iteration, the device), outermost first; the observer gives the payload's length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jamp import _jax_compat as jc

SCAN, WHILE, COND, SHARD_MAP = "scan", "while", "cond", "shard_map"
# Scopes whose reports gain a level when they leave: the iteration of a loop, the device of a shard_map.
LEVELS = frozenset({SCAN, WHILE, SHARD_MAP})


@dataclasses.dataclass(frozen=True)
class Scope:
    """A loop, branch or shard_map around an equation."""

    kind: str  # SCAN, WHILE, COND or SHARD_MAP
    count: int | None  # a scan's length, a cond's number of branches, a shard_map's devices; None: a while loop
    index: int = 0  # the branch of a cond
    reverse: bool = False  # a scan that runs from its last element
    position: int = 0  # the observer's position (equations recorded) when the body was entered


class Observer:
    """A tool that watches the interpreter through its hook (:func:`jamp.tools.bodies.hook`).

    ``threads``: it keeps a shadow beside every value and reports arrays out of bodies (see :class:`Frame`).
    ``payload``: the length of a report's payload. ``position``: equations recorded so far, in evaluation
    order (a body's scope keeps where it was entered).
    """

    threads = False
    payload = 0

    def __init__(self):
        self.position = 0
        self._pairs: dict[int, tuple[Any, Any]] = {}  # id(object walked) -> (it, the one its shadow runs)

    def record(self, call, effective: str, outs: list, frame: Frame, whole: bool) -> None:
        """After ``call``'s equation ran under the rule ``effective`` and returned ``outs``, in ``frame``; ``whole``:
        a higher-order equation whose body the observer did not see equation by equation."""
        self.position += 1

    def pair(self, walked: Any, shadowed: Any) -> None:
        """Shadows of ``walked`` (an equation, a jaxpr) run ``shadowed`` (a float32 trace of the same code; None:
        an equation whose output's shadow is its input's, :mod:`jamp.tools.pairing`)."""
        self._pairs[id(walked)] = (walked, shadowed)

    def shadowed(self, walked: Any) -> Any:
        """What the shadows of ``walked`` run: itself, unless :meth:`pair` said otherwise."""
        hit = self._pairs.get(id(walked))
        if hit is not None and hit[0] is walked:
            return hit[1]
        if isinstance(walked, jc.ClosedJaxpr) and id(walked.jaxpr) in self._pairs:
            return jc.ClosedJaxpr(self.shadowed(walked.jaxpr), walked.consts)
        return walked


class Frame:
    """One evaluation of a jaxpr as an observer sees it: the shadow of each value (``shadow`` is None
    where there are none: no observer, one that does not thread, a while loop's condition) and the
    reports made in it, ``(site, array)`` pairs in evaluation order (a call's body shares its caller's), and the
    scopes around it, outermost first."""

    def __init__(self, observer: Observer, shadow: dict | None = None, reports: list | None = None, scope: tuple = ()):
        self.observer = observer
        self.shadow = shadow
        self.reports: list = [] if reports is None else reports
        self.scope = scope

    @property
    def threads(self) -> bool:
        return self.shadow is not None

    def read(self, vs, like=None) -> list:
        """The shadows of ``vs`` (none without shadows); a literal is read from ``like`` (the paired
        equation's inputs), whose dtype is the shadow's."""
        if not self.threads:
            return []
        like = vs if like is None else like
        return [jc.literal_value(w) if isinstance(w, jc.Literal) else self.shadow[v] for v, w in zip(vs, like)]

    def write(self, vs, values) -> None:
        if self.threads:
            self.shadow.update(zip(vs, values))

    def has(self, vs) -> bool:
        return self.threads and all(isinstance(v, jc.Literal) or v in self.shadow for v in vs)

    def child(self, jaxpr: jc.Jaxpr, consts, shadows: list | None) -> Frame:
        """The frame of ``jaxpr`` evaluated within this one (a call entered in place; from a fresh frame, a body
        re-traced on its own): it shares this frame's reports; ``consts`` are its constants' shadows,
        ``shadows`` its inputs' (None: it has none)."""
        frame = Frame(self.observer, None if shadows is None else {}, self.reports, self.scope)
        frame.write(jaxpr.constvars, consts)
        frame.write(jaxpr.invars, shadows or ())
        return frame
