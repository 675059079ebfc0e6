DROP FUNCTION IF EXISTS pgrl_abort_unless(boolean, text);
