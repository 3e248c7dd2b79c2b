# Sourced by .ci/run: sets up the container engines that the `docker` tests use.
# (Filled in by the sandboxes work; until then the sandbox tests do not exist.)
true
