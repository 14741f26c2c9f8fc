"""The HTTP API: the aiohttp application and its middlewares, the routes (`routes`) and
their request and response bodies (`types`), decoding and checking a body (`decode`,
`inputs`), encoding outputs (with `infinity.shared.vectors`), fetching media by URL, connection limits,
metrics and the OpenAPI document. Errors become HTTP statuses here and nowhere else
(`errors`). It drives the children through the engine client (`infinity.client`)."""
