"""What the tests and the benchmarks share: service processes, tiny local models, the mock LLM, network
namespaces, the sandbox escape suite, live-stack helpers and run accounting. bench/ may import it; services/,
shared/ and infra/ never do (tests/contract/test_layering.py checks both)."""
