"""The CP group's collectives, one concern per module, each importing only the ones above it in this list:

- `record`: where a collective runs (`site`), what it was (`Record`), and this rank's debug record of them;
- `communication`: every communication goes through `communicate` — recorded in debug mode, a failure or a timeout
  raised as `CollectiveError`; the ranks' debug comparison; the groups' timeouts;
- `order`: the one order of every rank's collectives (the order token's chain, `CollectiveOrder`);
- `differentiable`: the differentiable collectives (all-to-all, gathers, the loss's sum, the rows' exchange), each
  with its gradient contract;
- `passes`: the ring's point-to-point passes, started and waited for apart (no autograd).

Nothing is re-exported here: import from the module that holds the concern.
"""
