"""elastor_ds."""
