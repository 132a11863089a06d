"""Low-precision parameters without float32 master copies: Kahan-compensated and stochastically rounded updates.

Optimizer-side, like :mod:`jamp.scaling`: optax transformations that wrap the optimizer and turn its update
of each float16/bfloat16 parameter into the float32 difference that lands ``optax.apply_updates`` exactly on
the compensated (:mod:`.kahan`) or stochastically rounded (:mod:`.stochastic`) value. :mod:`.grid` rounds
onto a low-precision format's values in float32 arithmetic, :mod:`.leaves` says which leaves are treated and
how the wrapped optimizer sees them.
"""
