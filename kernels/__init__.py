"""Hot-path ops: each ``kernels/<op>/`` holds a reference, an XLA implementation, optional
Pallas kernels and a dispatcher; the rest of the project calls one function per op."""
