-- Drops the request ids: checks with a request id fail until migrated up.
DROP TABLE pgrl_request;
