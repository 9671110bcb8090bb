"""Adapters of other libraries' KDA kernels, one module per library: FLA's (fla.py), AITER's (aiter.py),
FlashKDA's (flashkda.py) and the copies servers vendor (vendored.py, loaded by ../vendored_trees.py). Each
calls its library's public entry point as a server's layer does and declares what it takes (its envelope),
its libraries and its working precision. The machinery they run in (the protocol, the guard, the serving
harness, the registry) is the package above; the suite's own baseline, which plugins subclass, is
../torch_chunk.py."""
