"""The R-Part core both sides import: the KV store and attention kernel (`kernels`, C++ in csrc/),
the wire format (`wire`, `proto/`), credentials (`auth`), KV formats and sizes (`formats`) and the
errors (`errors`). No torch: an R-worker host runs on numpy, grpcio and the kernel alone."""
