"""The test machine's own health while suites measure: the sampler and its windows (machine), the
/proc readings behind it (procfs), and the harness's own memory over a long run (selfmem)."""
