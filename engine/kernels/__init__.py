"""The machine under the model: what this CPU can do (the one ISA probe), inductor tuned
for its vector width, and our C++ kernels (csrc/, built at install for each ISA this CPU
runs, or at first use)."""
