"""One package per service; services never import each other."""
