"""python -m portable_zip.weights: the weight-sync example (example.py)."""
from .example import main

main()
