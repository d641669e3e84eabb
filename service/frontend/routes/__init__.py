"""HTTP routes, one module per area; thin: parse → call service modules / models → respond."""
