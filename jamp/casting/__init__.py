"""autocast: trace a function to a jaxpr and evaluate it again under a policy of per-op dtypes."""
