"""Model folders: where a model's files are and what its folder says (`resolve`), with
one reader per family of folder (multi-vector, two-tower, page retrieval)."""
