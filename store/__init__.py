"""store: embedding rows (vector + Adam moments) keyed by 64-bit feature ids, behind one interface.

Imports no other project package.
"""
