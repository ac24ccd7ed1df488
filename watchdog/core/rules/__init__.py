"""The ladder's rules below the wait-for graph, one module per kind of evidence (``core.verdict`` weighs them)."""
