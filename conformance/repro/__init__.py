"""Tools that turn a failure into something to hand on: a smaller case that fails the same way
(``minimize``, ``kda-conformance minimize``) and a standalone pytest file (``standalone``,
``kda-conformance repro --write-test``)."""
