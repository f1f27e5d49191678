"""The .proto files (single source of truth for both APIs) and their generated Python code.

Regenerate with `python -m protos.generate`; tests/test_protos.py proves the checked-in code matches.
"""

# Version of the scheduler <-> worker protocol (worker.proto). A scheduler refuses a worker that
# speaks another one; bump it on any change of meaning, not only of layout.
WORKER_PROTOCOL_VERSION = 10
