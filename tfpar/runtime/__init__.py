"""tfpar.runtime."""
