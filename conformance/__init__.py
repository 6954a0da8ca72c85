"""The conformance suite: the op registry, the one differential tester, and the tests of both
implementations (installed as ``dsv4mtp.conformance``)."""
