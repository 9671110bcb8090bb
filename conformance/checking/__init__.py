"""What the checks share (the checks themselves are conformance/checks/, one module each): the shape of a
check and its registry (``registry``), inputs derived from a case's (``derived``), and a backend run through
the serving harness (``served``)."""
