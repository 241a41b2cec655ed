"""Every command-line interface of kernelkit (`kernelkit doctor | profile | bench | check | ladder | tune`): the top
floor, which nothing in kernelkit imports."""
