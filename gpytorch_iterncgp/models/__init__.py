r"""Models built on the layers below: the GP-LVM and the noisy-input classifier (:mod:`.gplvm`), and GP-ALPS
(:mod:`.alps`, with its Gibbs sampler in :mod:`.alps_gibbs`)."""
