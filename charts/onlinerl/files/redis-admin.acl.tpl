user admin reset on #@admin@ ~* &* +@all
user default reset off
