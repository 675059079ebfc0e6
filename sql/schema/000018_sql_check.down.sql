DROP FUNCTION IF EXISTS pgrl_check(text, text, bigint);
