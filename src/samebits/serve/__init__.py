"""`samebits serve`: the AsyncEngine's HTTP face (OpenAI-compatible and SGLang-style endpoints)."""
