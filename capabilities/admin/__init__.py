"""The owner's consoles for capabilities, one module each: the capabilities themselves, their
versions, their traffic splits, and the bindings they may declare. Importing the package
registers them all with the admin site."""

from capabilities.admin.bindings import AgentAdmin, BindingAdmin
from capabilities.admin.capabilities import PAGE_ACTIONS, CapabilityAdmin

__all__ = ["PAGE_ACTIONS", "AgentAdmin", "BindingAdmin", "CapabilityAdmin"]
