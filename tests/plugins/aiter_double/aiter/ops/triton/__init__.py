"""TEST DOUBLE of aiter.ops.triton (see tests/plugins/aiter_double/README.md)."""
