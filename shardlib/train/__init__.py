"""Training: the state, the step, the objective and the step-level strategies. The
package is also the training function: ``shardlib.train(config, model=...)``."""
