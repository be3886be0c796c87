"""``python -m relay_hf serve MODEL [transformers serve's options]``: see ``relay_hf.serve``."""

from .serve import main

main()
