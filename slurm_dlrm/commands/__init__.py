"""Click commands, one module per area (glue only; logic lives in the library)."""
