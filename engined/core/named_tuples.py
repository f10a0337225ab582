"""How the hot paths build a NamedTuple.

Calling a NamedTuple class runs the `__new__` that `collections.namedtuple` generates in
Python, and the compiled core calls it as any Python function; `tuple.__new__(cls, values)`
builds the same tuple in C, several times cheaper. The core builds one per scheduled
request, sampled token, allocation, command and admitted prompt.
"""

from __future__ import annotations

new_tuple = tuple.__new__
