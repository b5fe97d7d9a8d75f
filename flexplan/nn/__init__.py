"""torch.nn modules over the flexplan ops."""
