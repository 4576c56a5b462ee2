"""Pure math kernels of Gefen: tensor in, tensor out. Nothing here knows about optimizers."""
