"""Dynamic loss scaling: torch's GradScaler as an optax transformation with an immutable state."""
