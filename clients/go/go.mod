module github.com/ticketd/ticketd/clients/go

go 1.19
