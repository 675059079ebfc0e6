-- Support for deciding several limits at once.
--
-- A multi-limit decision sends its checks and then one statement that calls
-- pgrl_abort_unless with whether every check was allowed, all in one round
-- trip and one implicit transaction. When a check was denied the function
-- raises, the transaction rolls back, and no limit is consumed.
CREATE FUNCTION pgrl_abort_unless(ok boolean, message text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF ok IS NOT TRUE THEN
        RAISE EXCEPTION USING ERRCODE = 'PGRL1', MESSAGE = message;
    END IF;
    RETURN true;
END
$$;
