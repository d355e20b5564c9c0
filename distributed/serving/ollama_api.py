"""(being written)"""

ADAPTERS, ROUTES, ERROR_BODIES = {}, {}, {}
