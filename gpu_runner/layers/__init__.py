"""Building blocks of the models: norms, rotary embedding, projections, activations."""
