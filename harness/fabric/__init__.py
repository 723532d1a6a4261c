"""The emulated datacenter fabric of the bundled cluster (namespaces, bridges, tc classes) and the
network measurements that need it: line rate, raw bandwidth, KV bandwidth, TCP-class probe.
See docs/fabric.md."""
