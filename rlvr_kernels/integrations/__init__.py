"""Drop-in replacements with the peers' exact signatures (``verl``, ``trl``).

Importing these modules does not import the peers: they only reproduce their numbers.
"""
